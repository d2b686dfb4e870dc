// The consistency (LCM) step of a bundle whose manifest says scheduler.type "lcm": the same
// arithmetic as runtime/lcm_step.py and the timestep rule of pocketdiff/scheduler_blocks.py (runtime/BUNDLE.md,
// "Order of calls"); the page calls it through schedulers.js's LCMScheduler. Plain module (no LiteRT import),
// so tests run it under node.
export const SCHEDULER_TYPES = ['ddim', 'lcm'];

/** strength as a number in (0, 1] (img2img), else an error naming it. */
export function checkedStrength(strength) {
  if (!(typeof strength === 'number' && Number.isFinite(strength) && strength > 0 && strength <= 1)) {
    throw new Error(`strength must be a number in (0, 1], got ${JSON.stringify(strength)}`);
  }
  return strength;
}

/** Descending timesteps of an N-step run on the K-point training grid t_n = (n + 1) * (T // K) - 1; with
 * strength s < 1 on its first trunc(K s) points (diffusers' LCMScheduler.set_timesteps(N, strength=s)). The
 * indices are numpy's floor(linspace(0, points, N, endpoint=False)): floor(i * (points / N)) in doubles. */
export function lcmTimesteps(T, K, N, strength = 1) {
  const s = checkedStrength(strength);
  if (!(Number.isInteger(K) && K >= 1 && K <= T)) throw new Error(`original_inference_steps must be in [1, ${T}], got ${K}`);
  if (!(Number.isInteger(N) && N >= 1 && N <= K)) {
    throw new Error(`a consistency student trained on a ${K}-point grid samples with 1 to ${K} steps, got ${N}`);
  }
  const points = Math.trunc(K * s);
  if (points < N) throw new Error(`strength ${s} keeps ${points} of the ${K}-point grid's points, fewer than the ${N} steps`);
  const grid = [];
  for (let n = points - 1; n >= 0; n--) grid.push((n + 1) * Math.floor(T / K) - 1);
  const out = [];
  for (let i = 0; i < N; i++) out.push(grid[Math.floor(i * (points / N))]);
  return out;
}

/** What the page cannot run in a manifest's scheduler block, as one message, or null. */
export function schedulerProblem(sched) {
  const type = sched?.type ?? 'ddim';
  if (!SCHEDULER_TYPES.includes(type)) {
    return `bundle: scheduler type ${JSON.stringify(type)} is not supported by the page (it runs ${SCHEDULER_TYPES.join(' and ')})`;
  }
  const clip = sched.clip_sample_range ?? null;
  if (clip !== null && !(Number.isFinite(clip) && clip > 0)) {
    return `manifest: scheduler.clip_sample_range must be null (no clipping) or a finite number > 0, got ${JSON.stringify(clip)}`;
  }
  if (type !== 'lcm') return null;
  if (!['epsilon', 'v_prediction', 'sample'].includes(sched.prediction_type)) {
    return `manifest: scheduler.prediction_type must be epsilon, v_prediction or sample for lcm, got ${JSON.stringify(sched.prediction_type)}`;
  }
  for (const k of ['timestep_scaling', 'sigma_data']) {
    if (!(Number.isFinite(sched[k]) && sched[k] > 0)) return `manifest: scheduler.${k} must be a finite number > 0, got ${JSON.stringify(sched[k])}`;
  }
  let want;
  try {
    want = lcmTimesteps(sched.num_train_timesteps, sched.original_inference_steps, sched.steps);
  } catch (e) {
    return `manifest: scheduler: ${e.message}`;
  }
  if (JSON.stringify(want) !== JSON.stringify(sched.timesteps)) {
    return `manifest: scheduler.timesteps ${JSON.stringify(sched.timesteps)} are not ${sched.steps} lcm steps on the ${sched.original_inference_steps}-point grid (${JSON.stringify(want)})`;
  }
  return null;
}

/** denoised = c_out * x0 + c_skip * x at timestep t (x0 from the model output, clipped when the block says). */
export function lcmStep(x, out, t, aT, sched) {
  const sa = Math.sqrt(aT), sb = Math.sqrt(1 - aT);
  const s = t * sched.timestep_scaling, sd2 = sched.sigma_data * sched.sigma_data;
  const cSkip = sd2 / (s * s + sd2), cOut = s / Math.sqrt(s * s + sd2);
  const clip = sched.clip_sample_range ?? null;
  const p = sched.prediction_type; // schedulerProblem checked it when the bundle opened
  const y = new Float32Array(x.length);
  for (let i = 0; i < x.length; i++) {
    let x0 = p === 'epsilon' ? (x[i] - sb * out[i]) / sa : p === 'v_prediction' ? sa * x[i] - sb * out[i] : out[i];
    if (clip !== null) x0 = Math.min(clip, Math.max(-clip, x0));
    y[i] = cOut * x0 + cSkip * x[i];
  }
  return y;
}

/** The estimate noised to the next timestep (alphas_cumprod aNext there). */
export function renoise(denoised, aNext, noise) {
  const a = Math.sqrt(aNext), b = Math.sqrt(1 - aNext);
  const y = new Float32Array(denoised.length);
  for (let i = 0; i < y.length; i++) y[i] = a * denoised[i] + b * noise[i];
  return y;
}
