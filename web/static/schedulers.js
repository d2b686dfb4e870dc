// The page's schedulers: DDIM (eta 0) and the consistency (LCM) step behind one interface, the twin of
// runtime/schedulers.py and of pocketdiff/scheduler_blocks.py's timestep rules (diffusers' interface: setTimesteps +
// step; img2img's strength and addNoise). Plain module (no LiteRT import), so tests run it under node against
// diffusers (tests/runtime/test_schedulers.py, tests/runtime/test_scheduler_vectors.py).
//
//   const s = schedulerFor(manifest.scheduler);      // the manifest's timesteps (schedulerFor(block, strength): img2img's)
//   let x = s.addNoise(x0, noise, s.timesteps[0]);   // img2img only: the encoded image noised to the first timestep
//   for (const t of s.timesteps) x = s.step(out(x, t), t, x, noise).prevSample;
//
// `noise` (LCM only): a Float32Array, or a function returning one, used to re-noise before every step but
// the last (a function is called only then). DDIM draws nothing.
import { checkedStrength, lcmStep, lcmTimesteps, renoise, schedulerProblem, SCHEDULER_TYPES } from './lcm.js';

export { schedulerProblem, SCHEDULER_TYPES };
export const SPACINGS = ['leading', 'trailing', 'linspace'];

/** numpy's round (half to even), so timesteps equal numpy's where a spacing lands on .5. */
function roundHalfEven(v) {
  const r = Math.round(v);
  return Math.abs(v % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/** numpy's arange(T, 0, -ratio): ceil(T / ratio) values; the third on as start + i * ((start - ratio) - start). */
function numpyArangeDown(T, ratio) {
  const n = Math.ceil(T / ratio), delta = (T - ratio) - T, out = [];
  for (let i = 0; i < n; i++) out.push(i === 0 ? T : i === 1 ? T - ratio : T + i * delta);
  return out;
}

/** Descending DDIM timesteps as diffusers' DDIMScheduler.set_timesteps gives them (pocketdiff/scheduler_blocks.py's
 * ddim_timesteps). No defaults: a ddim block carries its spacing and steps_offset. */
export function spacingTimesteps(T, steps, spacing, offset) {
  if (!(Number.isInteger(steps) && steps >= 1 && steps <= T)) throw new Error(`steps must be in [1, ${T}] (num_train_timesteps), got ${steps}`);
  if (!(Number.isInteger(offset) && offset >= 0)) throw new Error(`steps_offset must be a non-negative integer (no default), got ${JSON.stringify(offset)}`);
  let out = [];
  if (spacing === 'leading') {
    for (let i = steps - 1; i >= 0; i--) out.push(i * Math.floor(T / steps) + offset);
  } else if (spacing === 'trailing') {
    out = numpyArangeDown(T, T / steps).map((v) => roundHalfEven(v) - 1);
  } else if (spacing === 'linspace') {
    const d = steps > 1 ? (T - 1) / (steps - 1) : 0;
    for (let i = steps - 1; i >= 0; i--) out.push(roundHalfEven(i === steps - 1 && steps > 1 ? T - 1 : i * d));
  } else {
    throw new Error(`timestep_spacing must be one of ${SPACINGS.join(', ')}, got ${JSON.stringify(spacing)}`);
  }
  const bad = out.find((t) => t < 0 || t >= T);
  if (bad !== undefined) throw new Error(`${steps} ${spacing} steps with steps_offset ${offset} give timestep ${bad}, outside [0, ${T})`);
  return out;
}

/** The last min(trunc(n s), n) of n timesteps (diffusers' img2img get_timesteps); none kept is an error. */
export function strengthTimesteps(timesteps, strength) {
  const s = checkedStrength(strength), n = timesteps.length, keep = Math.min(Math.trunc(n * s), n);
  if (keep < 1) throw new Error(`strength ${s} keeps none of the ${n} steps (int(${n} x ${s}) = 0): raise strength or steps`);
  return timesteps.slice(n - keep);
}

/** The timesteps of a `steps`-step run (img2img: strength < 1) under a scheduler block's rule. */
export function timestepsFor(block, steps, strength = 1) {
  const type = block.type ?? 'ddim', T = block.num_train_timesteps;
  if (type === 'lcm') return lcmTimesteps(T, block.original_inference_steps, steps, strength);
  if (type !== 'ddim') throw new Error(`bundle: scheduler type ${JSON.stringify(type)} is not supported (the page runs ${SCHEDULER_TYPES.join(' and ')})`);
  return strengthTimesteps(spacingTimesteps(T, steps, block.timestep_spacing, block.steps_offset), strength);
}

/** x0 noised to a timestep whose alphas_cumprod is aT: sqrt(aT) x0 + sqrt(1 - aT) noise (Float32Array). */
export function addNoise(x0, noise, aT) {
  const a = Math.sqrt(aT), b = Math.sqrt(1 - aT), y = new Float32Array(x0.length);
  for (let i = 0; i < y.length; i++) y[i] = a * x0[i] + b * noise[i];
  return y;
}

function checkedTimesteps(ts, T, name) {
  const ok = ts.length > 0 && ts.every((t, i) => Number.isInteger(t) && t >= 0 && t < T && (i === 0 || t < ts[i - 1]));
  if (!ok) throw new Error(`${name}: timesteps must be a non-empty strictly decreasing list in [0, ${T}), got ${JSON.stringify(ts)}`);
  return ts.slice();
}

class BaseScheduler {
  constructor(config) {
    this.config = config;
    this.timesteps = [];
    this.numInferenceSteps = null;
  }

  indexOf(t) {
    if (this.numInferenceSteps === null) throw new Error(`${this.name}: call setTimesteps before step`);
    const i = this.timesteps.indexOf(t);
    if (i < 0) throw new Error(`${this.name}: timestep ${t} is not one of its timesteps ${JSON.stringify(this.timesteps)}`);
    return i;
  }

  /** setTimesteps(n) from the config, or setTimesteps(null, [...]) with the timesteps given (a manifest's); strength < 1
   * (img2img): given timesteps and DDIM's keep their last trunc(n s), LCM's come from the first trunc(K s) grid points.
   * numInferenceSteps stays the full count (DDIM's stride T // steps, as diffusers keeps it). */
  setTimesteps(numInferenceSteps, timesteps = null, strength = 1) {
    if ((numInferenceSteps == null) === (timesteps == null)) throw new Error(`${this.name}.setTimesteps: give exactly one of steps and timesteps`);
    const T = this.config.num_train_timesteps;
    if (timesteps == null) {
      this.timesteps = checkedTimesteps(timestepsFor({ ...this.config, type: this.name }, numInferenceSteps, strength), T, this.name);
      this.numInferenceSteps = numInferenceSteps;
    } else {
      this.numInferenceSteps = checkedTimesteps(timesteps, T, this.name).length;
      this.timesteps = strengthTimesteps(timesteps, strength);
    }
  }

  /** The clean latents noised to timestep t (img2img's start). */
  addNoise(x0, noise, t) {
    const a = this.config.alphas_cumprod;
    if (!(Number.isInteger(t) && t >= 0 && t < a.length)) throw new Error(`${this.name}: addNoise at timestep ${t}, outside [0, ${a.length})`);
    return addNoise(x0, noise, a[t]);
  }
}

/** DDIM with eta 0: x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps, prev = t - T // steps. */
export class DDIMScheduler extends BaseScheduler {
  get name() { return 'ddim'; }

  step(out, t, x) {
    this.indexOf(t);
    const c = this.config;
    const prev = t - Math.floor(c.num_train_timesteps / this.numInferenceSteps);
    const aT = c.alphas_cumprod[t], aPrev = prev >= 0 ? c.alphas_cumprod[prev] : c.final_alpha_cumprod;
    const sa = Math.sqrt(aT), sb = Math.sqrt(1 - aT), pa = Math.sqrt(aPrev), pb = Math.sqrt(1 - aPrev);
    const p = c.prediction_type;
    if (p !== 'epsilon' && p !== 'v_prediction') throw new Error(`bundle: prediction type ${p} is not supported`);
    const clip = c.clip_sample_range ?? null;  // diffusers' clip_sample: x0 clipped, eps kept as predicted
    const prevSample = new Float32Array(x.length), x0s = new Float32Array(x.length);
    for (let i = 0; i < x.length; i++) {
      let x0 = p === 'epsilon' ? (x[i] - sb * out[i]) / sa : sa * x[i] - sb * out[i];
      if (clip !== null) x0 = Math.min(clip, Math.max(-clip, x0));
      const eps = p === 'epsilon' ? out[i] : sa * out[i] + sb * x[i];
      x0s[i] = x0;
      prevSample[i] = pa * x0 + pb * eps;
    }
    return { prevSample, predOriginalSample: x0s };
  }
}

/** The consistency step (lcm.js holds the arithmetic): denoised, re-noised to the next timestep but after the last. */
export class LCMScheduler extends BaseScheduler {
  get name() { return 'lcm'; }

  step(out, t, x, noise = null) {
    const i = this.indexOf(t);
    const a = this.config.alphas_cumprod;
    const denoised = lcmStep(x, out, t, a[t], this.config);
    if (i === this.timesteps.length - 1) return { prevSample: denoised, predOriginalSample: denoised };
    const drawn = typeof noise === 'function' ? noise() : noise;
    if (!drawn) throw new Error(`lcm: step ${i} at timestep ${t} re-noises: give the noise`);
    return { prevSample: renoise(denoised, a[this.timesteps[i + 1]], drawn), predOriginalSample: denoised };
  }
}

/** The scheduler of a manifest's scheduler block, on the manifest's timesteps (schedulerProblem checked it); with
 * strength < 1 (img2img) on setTimesteps(steps, null, strength)'s partial schedule instead. */
export function schedulerFor(block, strength = 1) {
  const type = block.type ?? 'ddim';
  const s = type === 'lcm' ? new LCMScheduler(block) : type === 'ddim' ? new DDIMScheduler(block) : null;
  if (!s) throw new Error(`bundle: scheduler type ${JSON.stringify(type)} is not supported by the page (it runs ${SCHEDULER_TYPES.join(' and ')})`);
  s.setTimesteps(null, block.timesteps);
  if (strength !== 1) s.setTimesteps(s.timesteps.length, null, strength);
  return s;
}
