// schedulers.js (and lcm.js) on tests/data/scheduler_vectors.json for tests/runtime/test_scheduler_vectors.py.
// argv: <static dir> <vectors json>; prints one JSON answer: what the page's rules give for every case (an error as
// null), add_noise, and the img2img walks (the start latents and every step), for Python to compare with diffusers'.
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';
import { join } from 'node:path';

const [dir, vectorsPath] = process.argv.slice(2);
const v = JSON.parse(readFileSync(vectorsPath, 'utf8'));
const s = await import(pathToFileURL(join(dir, 'schedulers.js')).href);
const alphas = v.alphas_cumprod;
const orNull = (f) => { try { return f(); } catch (e) { return null; } };

const ddimBlock = (c) => ({ type: 'ddim', num_train_timesteps: c.num_train_timesteps, timestep_spacing: c.timestep_spacing,
  steps_offset: c.steps_offset, alphas_cumprod: alphas, final_alpha_cumprod: alphas[0], prediction_type: 'epsilon' });
const lcmBlock = (c) => ({ type: 'lcm', num_train_timesteps: c.num_train_timesteps, original_inference_steps: c.original_inference_steps,
  alphas_cumprod: alphas, prediction_type: 'epsilon', timestep_scaling: 10, sigma_data: 0.5, clip_sample_range: null });

/** Per case: the rule's timesteps, and per strength timestepsFor's and a scheduler's setTimesteps(steps, null, strength)'s. */
function rules(cases, block, Sched) {
  return cases.map((c) => {
    const b = block(c);
    const img2img = {}, objects = {};
    for (const k of Object.keys(c.img2img)) {
      img2img[k] = orNull(() => s.timestepsFor(b, c.steps, Number(k)));
      objects[k] = orNull(() => { const o = new Sched(b); o.setTimesteps(c.steps, null, Number(k)); return { ts: o.timesteps, n: o.numInferenceSteps }; });
    }
    return { timesteps: orNull(() => s.timestepsFor(b, c.steps)), img2img, objects };
  });
}

const out = {
  ddim: rules(v.ddim, ddimBlock, s.DDIMScheduler),
  ddim_spacing: v.ddim.map((c) => orNull(() => s.spacingTimesteps(c.num_train_timesteps, c.steps, c.timestep_spacing, c.steps_offset))),
  lcm: rules(v.lcm, lcmBlock, s.LCMScheduler),
  add_noise: v.add_noise.map((c) => {
    const o = new (c.type === 'lcm' ? s.LCMScheduler : s.DDIMScheduler)({ num_train_timesteps: 1000, alphas_cumprod: alphas });
    return { fn: Array.from(s.addNoise(Float32Array.from(c.x0), Float32Array.from(c.noise), alphas[c.t])),
             method: Array.from(o.addNoise(Float32Array.from(c.x0), Float32Array.from(c.noise), c.t)) };
  }),
  walks: v.walks.map((w) => {
    const sched = s.schedulerFor({ ...w.block, alphas_cumprod: alphas }, w.strength);
    let x = sched.addNoise(Float32Array.from(w.x0), Float32Array.from(w.noise), sched.timesteps[0]);
    const start = Array.from(x), steps = [];
    for (const [i, t] of sched.timesteps.entries()) {
      const row = w.steps[i];
      x = sched.step(Float32Array.from(row.model_output), t, x, row.noise ? () => Float32Array.from(row.noise) : null).prevSample;
      steps.push(Array.from(x));
    }
    return { timesteps: sched.timesteps, start, steps };
  }),
  bad_strength: [0, 1.5, NaN, -0.1, '0.5'].map((k) => orNull(() => s.timestepsFor(ddimBlock(v.ddim[3]), 4, k))),
  no_offset: orNull(() => s.timestepsFor({ ...ddimBlock(v.ddim[3]), steps_offset: undefined }, 4)),
};
process.stdout.write(JSON.stringify(out));
