// Runs web/static/stages.js under node for tests/web/test_stages_js.py (a plain module: nothing else is loaded).
// argv: <request json file>; prints one JSON answer:
//   manifests -> per manifest {derived, pipeline, problems, parts (per stage), error (checkPipeline's line or null)}
//   guidance  -> per case {prompts, stack, repeat, combine} on the given arrays
//   and the module's tables (registry, roles, families, kinds, output roles, chunkable order, inpainting UNet roles).
import { readFileSync } from 'node:fs';
import * as stages from '../../web/static/stages.js';

const req = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const out = {
  registry: stages.REGISTRY, roles: stages.ROLES, families: stages.FAMILIES, kinds: stages.STAGE_KINDS,
  output_roles: stages.OUTPUT_ROLES, chunkable: stages.CHUNKABLE, tiled_decoder: stages.TILED_DECODER,
  inpaint_unet_roles: stages.INPAINT_UNET_ROLES,
};
out.manifests = (req.manifests || []).map((man) => {
  let error = null;
  try {
    stages.checkPipeline(man);
  } catch (e) {
    error = { type: e.constructor.name, message: e.message };
  }
  const pipe = stages.pipelineOf(man);
  return {
    derived: stages.derivePipeline(man), pipeline: pipe, problems: stages.pipelineProblems(man), error,
    parts: Array.isArray(pipe.stages) ? pipe.stages.map((s) => (stages.REGISTRY[s?.component] ? stages.stageParts(man, s.component) : null)) : null,
  };
});
const tensor = (t) => ({ data: Float32Array.from(t.data), shape: t.shape });
const plain = (t) => ({ data: Array.from(t.data), shape: t.shape });
out.guidance = (req.guidance || []).map((c) => {
  const g = new stages.Guidance(c.block, c.scale, Boolean(c.zero));
  return {
    prompts: g.prompts(c.prompt), unconditional: g.unconditional,
    stack: plain(g.stack(c.rows.map(tensor))), repeat: plain(g.repeat(tensor(c.sample))),
    combine: Array.from(g.combine(Float32Array.from(c.out))),
  };
});
out.concat = (req.concat || []).map(([a, b]) => plain(stages.concatLast(tensor(a), tensor(b))));
console.log(JSON.stringify(out));
