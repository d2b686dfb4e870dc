// The page's schedulers: DDIM (eta 0) and the consistency (LCM) step behind one interface, the twin of
// runtime/schedulers.py (diffusers' interface: setTimesteps + step). Plain module (no LiteRT import), so
// tests/runtime/test_schedulers.py runs it under node against diffusers on the same vectors.
//
//   const s = schedulerFor(manifest.scheduler);      // the manifest's timesteps
//   for (const t of s.timesteps) x = s.step(out(x, t), t, x, noise).prevSample;
//
// `noise` (LCM only): a Float32Array, or a function returning one, used to re-noise before every step but
// the last (a function is called only then). DDIM draws nothing.
import { lcmStep, lcmTimesteps, renoise, schedulerProblem, SCHEDULER_TYPES } from './lcm.js';

export { schedulerProblem, SCHEDULER_TYPES };

/** numpy's round (half to even), so timesteps equal numpy's where a spacing lands on .5. */
function roundHalfEven(v) {
  const r = Math.round(v);
  return Math.abs(v % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/** Descending DDIM timesteps as diffusers' DDIMScheduler.set_timesteps gives them (runtime/manifest_fields.py). */
export function spacingTimesteps(T, steps, spacing = 'leading', offset = 0) {
  const out = [];
  if (spacing === 'leading') {
    for (let i = steps - 1; i >= 0; i--) out.push(i * Math.floor(T / steps) + offset);
  } else if (spacing === 'trailing') {
    const ratio = T / steps; // numpy's arange(T, 0, -ratio): ceil(T / ratio) values T - i * ratio
    for (let i = 0; i < Math.ceil(T / ratio); i++) out.push(roundHalfEven(T - i * ratio) - 1);
  } else if (spacing === 'linspace') {
    const d = steps > 1 ? (T - 1) / (steps - 1) : 0;
    for (let i = steps - 1; i >= 0; i--) out.push(roundHalfEven(i === steps - 1 && steps > 1 ? T - 1 : i * d));
  } else {
    throw new Error(`unknown timestep spacing ${JSON.stringify(spacing)}`);
  }
  return out;
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

  /** setTimesteps(n) from the config, or setTimesteps(null, [...]) with the timesteps given (a manifest's). */
  setTimesteps(numInferenceSteps, timesteps = null) {
    if ((numInferenceSteps == null) === (timesteps == null)) throw new Error(`${this.name}.setTimesteps: give exactly one of steps and timesteps`);
    const T = this.config.num_train_timesteps;
    this.timesteps = checkedTimesteps(timesteps ?? this.computeTimesteps(numInferenceSteps), T, this.name);
    this.numInferenceSteps = this.timesteps.length;
  }
}

/** DDIM with eta 0: x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps, prev = t - T // steps. */
export class DDIMScheduler extends BaseScheduler {
  get name() { return 'ddim'; }

  computeTimesteps(n) {
    const c = this.config;
    return spacingTimesteps(c.num_train_timesteps, n, c.timestep_spacing ?? 'leading', c.steps_offset ?? 0);
  }

  step(out, t, x) {
    this.indexOf(t);
    const c = this.config;
    const prev = t - Math.floor(c.num_train_timesteps / this.numInferenceSteps);
    const aT = c.alphas_cumprod[t], aPrev = prev >= 0 ? c.alphas_cumprod[prev] : c.final_alpha_cumprod;
    const sa = Math.sqrt(aT), sb = Math.sqrt(1 - aT), pa = Math.sqrt(aPrev), pb = Math.sqrt(1 - aPrev);
    const p = c.prediction_type;
    if (p !== 'epsilon' && p !== 'v_prediction') throw new Error(`bundle: prediction type ${p} is not supported`);
    const prevSample = new Float32Array(x.length), x0s = new Float32Array(x.length);
    for (let i = 0; i < x.length; i++) {
      const x0 = p === 'epsilon' ? (x[i] - sb * out[i]) / sa : sa * x[i] - sb * out[i];
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

  computeTimesteps(n) {
    return lcmTimesteps(this.config.num_train_timesteps, this.config.original_inference_steps, n);
  }

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

/** The scheduler of a manifest's scheduler block, on the manifest's timesteps (schedulerProblem checked it). */
export function schedulerFor(block) {
  const type = block.type ?? 'ddim';
  const s = type === 'lcm' ? new LCMScheduler(block) : type === 'ddim' ? new DDIMScheduler(block) : null;
  if (!s) throw new Error(`bundle: scheduler type ${JSON.stringify(type)} is not supported by the page (it runs ${SCHEDULER_TYPES.join(' and ')})`);
  s.setTimesteps(null, block.timesteps);
  return s;
}
