// The manifest's `pipeline` block in the page and the Node runner: the twin of runtime/pipeline_spec.py (and of the
// part of the registry it reads, runtime/components.py) and of runtime/guidance.py.
//
//   pipeline: {family, tasks, conditioning: {time_ids} (a UNet that takes time ids), stages: [{stage, kind, component,
//              tokenizer (encode_prompt only), inputs: {graph input name: role}, outputs: [role per output]}]}
//
// A stage's `kind` says what a runner does with it; its `component` is a whole registry component, run as its chunks
// (`<name>_chunks`) or its tiled parts (`vae_tiling`) where the bundle has them. Every graph input is fed by role
// (ROLES): the tokenizer, an earlier stage, the scheduler, the time-embedding table, a constant of the block, the
// latents; a per-prompt role is stacked [unconditional, conditional] under classifier-free guidance, a per-sample one
// repeated to the UNet's batch (Guidance). Bundles from before the block (schema_version 1, 2) are read through
// derivePipeline, which gives what the Python function gives (tests/web/test_stages_js.py compares them).
// pipelineProblems checks a block before any model loads and names the stage, component and input at fault.

/** What the page refuses a bundle with: one line (pipeline.js re-exports it). */
export class BundleError extends Error {}

export const PIPELINE_SCHEMA_VERSION = 3; // a manifest with a `pipeline` block; 1 and 2 are read through derivePipeline
export const ENCODE_PROMPT = 'encode_prompt';
export const DENOISE = 'denoise';
export const DECODE = 'decode';
export const ENCODE_IMAGE = 'encode_image'; // image-to-image and inpainting: the user's picture into latents
export const STAGE_KINDS = [ENCODE_PROMPT, ENCODE_IMAGE, DENOISE, DECODE];
export const TASKS = ['text_to_image', 'image_to_image', 'inpaint'];
export const INPAINT_UNET_ROLES = ['mask', 'masked_image_latents']; // the roles that make a UNet an inpainting one (components.py)
export const PROMPT = 'prompt';
export const SAMPLE = 'sample';
export const MODEL = 'model'; // one value for every batch row (a LoRA slot's factors)

const role = (source, per, rank) => Object.freeze({ source, per, rank });
/** Where a graph input's value comes from (`source`) and how it meets the UNet's batch (`per`). */
export const ROLES = Object.freeze({
  token_ids: role('tokenizer', PROMPT, 2), // [1, L] int32: the stage's tokenizer
  prompt_embeds: role('stage', PROMPT, 3), // [rows, L, D]: encode stages' hidden states
  pooled_embeds: role('stage', PROMPT, 2), // [rows, P]: a pooled text embedding
  time_ids: role('constant', SAMPLE, 2), // [B, K]: pipeline.conditioning.time_ids
  timestep: role('scheduler', SAMPLE, 1), // [B] float32
  timestep_embedding: role('table', SAMPLE, 2), // [B, W]: the time-embedding table's row of the timestep
  latents: role('latents', SAMPLE, 4), // [B, C, h, w] (the decoder: [1, C, h, w])
  guidance_embedding: role('none', SAMPLE, 2), // a w-conditioned student's timestep_cond: no runner feeds it
  noise_pred: role('stage', SAMPLE, 4),
  image: role('stage', SAMPLE, 4),
  init_image: role('picture', SAMPLE, 4), // [1, 3, H, W] in [0, 1]: the user's picture
  image_latents: role('stage', SAMPLE, 4), // [1, C, h, w]: the encoder's latents of it
  // an inpainting UNet's (9 channels): the mask on the latent grid [B, 1, h, w], the picture with the repainted part
  // grey [1, 3, H, W] and its latents [B, C, h, w] (an encode_image stage's)
  mask: role('picture', SAMPLE, 4),
  masked_image: role('picture', SAMPLE, 4),
  masked_image_latents: role('stage', SAMPLE, 4),
  lora_factors: role('adapter', MODEL, 2), // a LoRA slot's down [in, rank] / up [rank, out] (manifest lora_slots; lora.js)
});
export const OUTPUT_ROLES = Object.freeze({
  [ENCODE_PROMPT]: ['prompt_embeds', 'pooled_embeds'], [ENCODE_IMAGE]: ['image_latents', 'masked_image_latents'], [DENOISE]: ['noise_pred'], [DECODE]: ['image'],
});

// The registry (runtime/components.py), the fields a runner reads: its role (text, denoise, decode), the inputs it feeds, what a component may be split
// into (chunks, tiles), its inputs' and outputs' roles; `spoken`: its name in the page's messages.
export const REGISTRY = Object.freeze({
  text_encoder: { role: 'text', inputs: ['input_ids'], chunks: true, roles: { input_ids: 'token_ids' }, outputRoles: ['prompt_embeds'], spoken: 'text encoder' },
  // the SDXL family's second text encoder: its penultimate states (beside the first's) and its projected pooled embedding
  text_encoder_2: {
    role: 'text', inputs: ['input_ids'], roles: { input_ids: 'token_ids' }, outputRoles: ['prompt_embeds', 'pooled_embeds'],
    comesWith: 'text_encoder', spoken: 'second text encoder',
  },
  unet: {
    role: 'denoise', inputs: ['sample', 'timestep', 'encoder_hidden_states'], optionalInputs: ['timestep_cond', 'mask', 'masked_image_latents'], chunks: true, spoken: 'UNet',
    roles: {
      sample: 'latents', timestep: 'timestep', encoder_hidden_states: 'prompt_embeds', timestep_cond: 'guidance_embedding', text_embeds: 'pooled_embeds', time_ids: 'time_ids',
      mask: 'mask', masked_image_latents: 'masked_image_latents',
    },
    outputRoles: ['noise_pred'],
  },
  vae_decoder: { role: 'decode', inputs: ['latents'], tiles: ['vae_decoder_head', 'vae_up_tile'], roles: { latents: 'latents' }, outputRoles: ['image'] },
  vae_decoder_head: { role: 'decode', inputs: ['latents'], partOf: 'vae_decoder' },
  vae_up_tile: { role: 'decode', inputs: ['features', 'weight', 'stats', 'own'], partOf: 'vae_decoder' },
  vae_encoder: { role: 'encode', inputs: ['pixels'], roles: { pixels: 'init_image' }, outputRoles: ['image_latents'], spoken: 'image encoder' },
});
/** A model family's stages in order: [stage name, kind, component, tokenizer block or null]. */
export const FAMILIES = Object.freeze({
  sd: [[ENCODE_PROMPT, ENCODE_PROMPT, 'text_encoder', 'tokenizer'], [DENOISE, DENOISE, 'unet', null], [DECODE, DECODE, 'vae_decoder', null]],
  sdxl: [[ENCODE_PROMPT, ENCODE_PROMPT, 'text_encoder', 'tokenizer'], ['encode_prompt_2', ENCODE_PROMPT, 'text_encoder_2', 'tokenizer_2'],
    [DENOISE, DENOISE, 'unet', null], [DECODE, DECODE, 'vae_decoder', null]],
});
export const COMPONENTS = Object.keys(REGISTRY).filter((n) => !REGISTRY[n].partOf);
// the models a bundle may hold in chunks, the denoiser's first (the order the page checks a manifest's chunks blocks in)
const denoiserFirst = (a, b) => (REGISTRY[b].role === 'denoise') - (REGISTRY[a].role === 'denoise');
export const CHUNKABLE = COMPONENTS.filter((n) => REGISTRY[n].chunks).sort(denoiserFirst);
const TILED_WHOLE = COMPONENTS.find((n) => REGISTRY[n].tiles);
export const TILED_DECODER = REGISTRY[TILED_WHOLE].tiles; // [head, up tile]: what a vae_tiling block without `components` means

const isObj = (v) => v !== null && typeof v === 'object' && !Array.isArray(v);
const has = (obj, key) => isObj(obj) && Object.prototype.hasOwnProperty.call(obj, key);
/** Python's truth of a JSON value (an empty object or list is false). */
const truthy = (v) => (Array.isArray(v) ? v.length > 0 : isObj(v) ? Object.keys(v).length > 0 : Boolean(v));
const pyStr = (v) => (typeof v === 'string' ? v : v === null || v === undefined ? 'None' : typeof v === 'boolean' ? (v ? 'True' : 'False') : String(v));
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

/** The manifest key of `base`'s chunks block: unet_chunks, text_encoder_chunks. */
export function blockKey(base) {
  return `${base}_chunks`;
}

/** The names of a one-pass up path in `k` graphs: [vae_up_tile], or vae_up_tile.0 ... vae_up_tile.k-1. */
export function upTileParts(k) {
  return k === 1 ? [TILED_DECODER[1]] : Array.from({ length: k }, (_, i) => `${TILED_DECODER[1]}.${i}`);
}

/** A vae_tiling block's components: its `components` when it names the head and the up path's parts, else the
 *  classic two (a malformed list is tiled.js tilingProblem's to report). */
export function tiledComponents(block) {
  const names = block.components;
  if (Array.isArray(names) && names.length >= 2 && names[0] === TILED_DECODER[0] && same(names.slice(1), upTileParts(names.length - 1))) return names.slice();
  return TILED_DECODER.slice();
}

/** The decoder's components: the tiled graphs (head, then the up path's) when the manifest has a vae_tiling block. */
export function decoderComponents(man) {
  return isObj(man.vae_tiling) ? tiledComponents(man.vae_tiling) : [TILED_WHOLE];
}

/** A model's chunks in call order (its `<base>_chunks` block's), else [base]. */
export function partsOf(man, base) {
  const block = man[blockKey(base)];
  return isObj(block) && Array.isArray(block.components) && block.components.length ? block.components.map(String) : [base];
}

/** The models a stage's component runs as: its chunks, its tiled parts, or itself. */
export function stageParts(man, component) {
  if (component === TILED_WHOLE) return decoderComponents(man);
  return CHUNKABLE.includes(component) ? partsOf(man, component) : [component];
}

/** The whole component's declared inputs ([{name, shape, dtype}]): its entry's, its chunks block's, or (tiled) the
 *  decoder head's; null when the manifest does not hold them. */
export function wholeInputs(man, component) {
  const comps = isObj(man.components) ? man.components : {};
  const block = CHUNKABLE.includes(component) ? man[blockKey(component)] : undefined;
  const entry = isObj(block) ? block : comps[stageParts(man, component)[0]];
  const items = isObj(entry) ? entry.inputs : undefined;
  return Array.isArray(items) ? items : null;
}

function rolesOf(man, component) {
  const reg = REGISTRY[component];
  const table = truthy(man.time_embedding);
  const roles = {};
  const items = wholeInputs(man, component);
  for (const item of items?.length ? items : reg.inputs.map((name) => ({ name }))) {
    const name = isObj(item) ? item.name : undefined;
    let r = typeof name === 'string' && has(reg.roles, name) ? reg.roles[name] : null;
    if (r === 'timestep' && table) r = 'timestep_embedding'; // the UNet's time embedding computed outside the graph
    roles[pyStr(name)] = r || 'unknown';
  }
  return roles;
}

/** The pipeline block of a manifest from the registry: `family`'s stages, each input's role (a bundle from before the
 *  block is read as this; runtime/pipeline_spec.py derive_pipeline). */
export function derivePipeline(man, family = 'sd') {
  const stages = FAMILIES[family].map(([stage, kind, component, tokenizer]) => ({
    stage, kind, component, ...(tokenizer ? { tokenizer } : {}), inputs: rolesOf(man, component), outputs: [...REGISTRY[component].outputRoles],
  }));
  return { family, tasks: ['text_to_image'], conditioning: {}, stages };
}

/** The manifest's pipeline block, or (a bundle from before it) the one its layout implies. */
export function pipelineOf(man) {
  return isObj(man.pipeline) ? man.pipeline : derivePipeline(man);
}

/** The pipeline's stages of one kind, in order. */
export function stagesOf(man, kind) {
  return (pipelineOf(man).stages || []).filter((s) => isObj(s) && s.kind === kind);
}

// ------------------------------------------------------------------------------- checks

const where = (i, stage) => `pipeline.stages[${i}]` + (typeof stage?.stage === 'string' ? ` (${stage.stage})` : '');
const named = (stage, comp, input) => `stage ${stage?.stage ?? '?'}, component ${comp ?? '?'}` + (input === undefined ? '' : `, input ${input}`);

/** Why a manifest's version and its pipeline block do not go together, or null (runtime/bundle.py _check_version's
 *  pipeline part; chunks.js checks the chunks blocks' versions). */
export function versionProblem(man) {
  const v = man.schema_version;
  if (v === PIPELINE_SCHEMA_VERSION && !isObj(man.pipeline)) return `manifest.json: schema version ${v} declares its pipeline, but the manifest has no pipeline block`;
  if (v !== PIPELINE_SCHEMA_VERSION && has(man, 'pipeline')) return `manifest.json: schema version ${v} cannot hold a pipeline block (version ${PIPELINE_SCHEMA_VERSION} does)`;
  return null;
}

/** The problems of one stage's own fields (kind, component present whole or in parts, inputs and outputs by known
 *  roles, its tokenizer), pushed on `found`; true when the stage can be checked further. */
function stageFieldProblems(i, stage, comps, man, found) {
  const at = where(i, stage);
  if (!isObj(stage)) return found.push(`${at}: must be an object {stage, kind, component, inputs, outputs}`) && false;
  const { kind, component: comp } = stage;
  if (!STAGE_KINDS.includes(kind)) return found.push(`${at}.kind: ${named(stage, comp)}: ${JSON.stringify(kind)} is no stage a runner knows (${STAGE_KINDS.join(', ')})`) && false;
  if (!has(REGISTRY, comp) || REGISTRY[comp].partOf) {
    return found.push(`${at}.component: ${named(stage, comp)}: ${JSON.stringify(comp)} is not a component of the registry (${Object.keys(REGISTRY).join(', ')})`) && false;
  }
  const missing = stageParts(man, comp).filter((p) => !has(comps, p));
  if (missing.length) return found.push(`bundle: has no ${missing.join(', ')} (exported with components=${Object.keys(comps)}), which ${at}: ${named(stage, comp)} runs`) && false;
  const { inputs: ins, outputs: outs } = stage;
  if (!isObj(ins) || !Object.values(ins).every((v) => typeof v === 'string')) return found.push(`${at}.inputs: ${named(stage, comp)}: must map each graph input's name to its role`) && false;
  if (!Array.isArray(outs) || !outs.length || !outs.every((r) => typeof r === 'string')) return found.push(`${at}.outputs: ${named(stage, comp)}: must list the role of each output, in order`) && false;
  const before = found.length;
  for (const [name, r] of Object.entries(ins)) {
    if (!has(ROLES, r) || r === 'noise_pred' || r === 'image' || r === 'image_latents') found.push(`${at}.inputs.${name}: ${named(stage, comp, name)}: role ${JSON.stringify(r)} is not one a runner feeds`);
    else if (ROLES[r].source === 'none') found.push(`${at}.inputs.${name}: ${named(stage, comp, name)}: no runner feeds role ${r} (re-export with rewrites.time_embedding_outside: true)`);
  }
  for (const r of outs) if (!OUTPUT_ROLES[kind].includes(r)) found.push(`${at}.outputs: ${named(stage, comp)}: a ${kind} stage makes ${OUTPUT_ROLES[kind].join(', ')}, not ${JSON.stringify(r)}`);
  if (kind === ENCODE_PROMPT && !isObj(man[stage.tokenizer])) found.push(`${at}.tokenizer: ${named(stage, comp)}: names ${JSON.stringify(stage.tokenizer)}, which is no tokenizer block of the manifest`);
  return found.length === before;
}

/** Each role a stage reads is made before it (by the runner's sources or an earlier stage); one denoise stage, then
 *  one decode stage. */
function orderProblems(stages, man, found) {
  const made = new Set(Object.keys(ROLES).filter((r) => !['stage', 'none'].includes(ROLES[r].source)));
  if (!has(man.pipeline?.conditioning, 'time_ids')) made.delete('time_ids');
  if (!truthy(man.time_embedding)) made.delete('timestep_embedding');
  if (!man.lora_slots || typeof man.lora_slots !== 'object') made.delete('lora_factors');
  stages.forEach((stage, i) => {
    for (const [name, r] of Object.entries(stage.inputs)) {
      if (!made.has(r) && ROLES[r].source !== 'none') found.push(`${where(i, stage)}.inputs.${name}: ${named(stage, stage.component, name)}: no earlier stage or bundle field makes ${r}`);
    }
    for (const r of stage.outputs) made.add(r);
  });
  const kinds = stages.map((s) => s.kind);
  const count = (k) => kinds.filter((x) => x === k).length;
  if (count(DENOISE) !== 1 || count(DECODE) !== 1 || kinds.indexOf(DENOISE) > kinds.indexOf(DECODE)) {
    found.push(`pipeline.stages: one denoise stage then one decode stage, got kinds ${JSON.stringify(kinds)}`);
  } else if (count(ENCODE_IMAGE) > 2 || (kinds.includes(ENCODE_IMAGE) && kinds.lastIndexOf(ENCODE_IMAGE) > kinds.indexOf(DENOISE))) {
    found.push(`pipeline.stages: at most two encode_image stages (the picture, the masked picture), before the denoise stage, got kinds ${JSON.stringify(kinds)}`);
  }
  const tasks = pipelineOf(man).tasks;
  const imageTasks = Array.isArray(tasks) ? tasks.filter((t) => t !== 'text_to_image' && TASKS.includes(t)) : [];
  if (imageTasks.length && !kinds.includes(ENCODE_IMAGE)) {
    found.push(`pipeline.tasks: ${imageTasks.join(', ')} start from the user's picture: the stages need an encode_image stage, got kinds ${JSON.stringify(kinds)}`);
  }
  const inpaintRoles = inpaintingRoles(stages);
  if (inpaintRoles.length && !same(tasks, ['inpaint'])) {
    found.push(`pipeline.tasks: the denoise stage reads ${inpaintRoles.join(', ')} (an inpainting UNet): the bundle serves inpaint only, got tasks ${JSON.stringify(tasks)}`);
  }
}

/** The inpainting roles (mask, masked_image_latents) the denoise stage reads, sorted: a 9-channel UNet's. */
export function inpaintingRoles(stages) {
  const found = new Set();
  for (const s of stages) if (isObj(s) && s.kind === DENOISE && isObj(s.inputs)) for (const r of Object.values(s.inputs)) if (INPAINT_UNET_ROLES.includes(r)) found.add(r);
  return [...found].sort();
}

/** Every problem of the manifest's pipeline (its block, or the derived one) against the registry and the manifest:
 *  version, stages, roles, order, the shapes each role feeds and reads (stageShapeProblems); one line each, the
 *  first naming the stage, component and input at fault. Empty when the page can run it. */
export function pipelineProblems(man) {
  const found = [];
  const version = versionProblem(man);
  if (version) return [version];
  if (has(man, 'pipeline') && !isObj(man.pipeline)) return ['pipeline: must be an object {family, tasks, stages}'];
  const pipe = pipelineOf(man);
  const stages = pipe.stages;
  if (!Array.isArray(stages) || !stages.length) return ['pipeline.stages: must list the stages in order'];
  if (!Array.isArray(pipe.tasks) || !pipe.tasks.length || pipe.tasks.some((t) => !TASKS.includes(t))) {
    found.push(`pipeline.tasks: must list tasks of ${TASKS.join(', ')}, got ${JSON.stringify(pipe.tasks)}`);
  }
  const comps = isObj(man.components) ? man.components : {};
  const fields = stages.map((s, i) => stageFieldProblems(i, s, comps, man, found));
  if (!fields.every(Boolean)) return found;
  orderProblems(stages, man, found);
  if (!found.length) stageShapeProblems(man, stages, found);
  return found;
}

/** Throws a BundleError with the pipeline's first problem (pipelineProblems), before any model loads. */
export function checkPipeline(man) {
  const [first] = pipelineProblems(man);
  if (first) throw new BundleError(/^(bundle|manifest\.json): /.test(first) ? first : `manifest.json: ${first}`);
}

// ------------------------------------------------------------------------------- shapes (runtime/stage_shapes.py)

/** name -> {shape} of a declared io list, or null when malformed (the whole model's, for a chunked one: its block's
 *  inputs and its last chunk's outputs). */
function ioOf(items) {
  if (!Array.isArray(items) || !items.length || !items.every((t) => isObj(t) && typeof t.name === 'string' && Array.isArray(t.shape))) return null;
  return Object.fromEntries(items.map((t) => [t.name, { shape: t.shape }]));
}

function wholeIo(man, comp) {
  const comps = isObj(man.components) ? man.components : {};
  const block = CHUNKABLE.includes(comp) ? man[blockKey(comp)] : undefined;
  if (isObj(block)) {
    const parts = partsOf(man, comp);
    const last = comps[parts[parts.length - 1]];
    return { ins: ioOf(block.inputs), outs: ioOf(last?.outputs) };
  }
  if (comp === TILED_WHOLE && isObj(man.vae_tiling)) return null; // a tiled decoder's io: tiled.js upPartsProblem and verify-bundle
  return { ins: ioOf(comps[comp]?.inputs), outs: ioOf(comps[comp]?.outputs) };
}

const section = (man, key) => (isObj(man[key]) ? man[key] : {});

/** The shape a role feeds a stage's input and what gives it, or null (nothing to check). `made`: the encode stages'
 *  token length and per role the widths they make. */
function wantInput(man, stage, r, made) {
  const lat = section(man, 'latent');
  const latent = [lat.channels, lat.height, lat.width];
  const B = stage.kind === DENOISE ? section(man, 'guidance').unet_batch : 1;
  const width = (key) => (made.widths[key]?.length && !made.widths[key].includes(null) ? made.widths[key].reduce((a, b) => a + b, 0) : null);
  switch (r) {
    case 'init_image': case 'masked_image': { const im = section(man, 'image'); return [[1, im.channels, im.height, im.width], 'image']; }
    case 'mask': return [[B, 1, ...latent.slice(1)], "guidance.unet_batch x 1 x the latent's size"];
    case 'masked_image_latents': return [[B, ...latent], 'guidance.unet_batch x latent'];
    case 'token_ids': return [[1, section(man, String(stage.tokenizer)).max_length], 'tokenizer.max_length'];
    case 'latents': return stage.kind === DENOISE ? [[B, ...latent], 'guidance.unet_batch x latent'] : [[1, ...latent], 'latent'];
    case 'timestep': return [[B], 'guidance.unet_batch (no time-embedding table)'];
    case 'timestep_embedding': {
      const shape = section(man, 'time_embedding').shape;
      return Array.isArray(shape) && shape.length === 2 ? [[B, shape[1]], 'guidance.unet_batch x the time-embedding width'] : null;
    }
    case 'time_ids': {
      const ids = section(section(man, 'pipeline'), 'conditioning').time_ids;
      return Array.isArray(ids) ? [[B, ids.length], 'guidance.unet_batch x pipeline.conditioning.time_ids'] : null;
    }
    case 'prompt_embeds': return width(r) === null ? null : [[B, made.length, width(r)], "guidance.unet_batch x the text encoder's output"];
    case 'pooled_embeds': return width(r) === null ? null : [[B, width(r)], 'guidance.unet_batch x the pooled embeddings'];
    default: return null;
  }
}

/** What an encode stage makes: its outputs' widths by role, and the token length. */
function noteEncodeOutputs(man, stage, outs, made) {
  const L = section(man, String(stage.tokenizer)).max_length;
  stage.outputs.forEach((r, k) => {
    const shape = Object.values(outs)[k]?.shape ?? [];
    const ok = r === 'prompt_embeds' ? shape.length === 3 && shape[0] === 1 && shape[1] === L : shape.length === 2 && shape[0] === 1;
    if (r === 'prompt_embeds' && made.length === null) made.length = L;
    (made.widths[r] ??= []).push(ok ? shape[shape.length - 1] : null);
  });
}

/** Every stage's role-fed inputs and its outputs against the shapes their roles give (runtime/stage_shapes.py's
 *  rules). */
function stageShapeProblems(man, stages, found) {
  const made = { length: null, widths: {} };
  stages.forEach((stage, i) => {
    const io = wholeIo(man, stage.component);
    if (!io?.ins || !io.outs) return; // a tiled decoder, or io the layout checks report
    const unfed = Object.keys(io.ins).filter((n) => !has(stage.inputs, n));
    if (unfed.length) found.push(`${where(i, stage)}.inputs: ${named(stage, stage.component, unfed[0])}: fed no role`);
    if (stage.outputs.length !== Object.keys(io.outs).length) {
      found.push(`${where(i, stage)}.outputs: ${named(stage, stage.component)}: ${Object.keys(io.outs).length} outputs, the stage names ${stage.outputs.length} roles`);
      return;
    }
    for (const [name, r] of Object.entries(stage.inputs)) {
      if (!has(io.ins, name)) {
        found.push(`${where(i, stage)}.inputs.${name}: ${named(stage, stage.component, name)}: the component has no such input (has ${Object.keys(io.ins).join(', ')})`);
        continue;
      }
      const want = wantInput(man, stage, r, made);
      if (want && !same(io.ins[name].shape, want[0])) {
        found.push(`components.${stage.component}.inputs.${name}: ${named(stage, stage.component, name)}: shape ${JSON.stringify(io.ins[name].shape)}, but ${want[1]} gives ${JSON.stringify(want[0])}`);
      }
    }
    if (stage.kind === ENCODE_PROMPT) noteEncodeOutputs(man, stage, io.outs, made);
    else outputProblem(man, stage, Object.values(io.outs)[0].shape, found);
  });
}

/** A denoise stage's output against [B, C, h, w], an encode-image stage's against [1, C, h, w], a decode stage's against
 *  the image [1, 3, H, W]. */
function outputProblem(man, stage, got, found) {
  const lat = section(man, 'latent'), image = section(man, 'image');
  const [want, what] = stage.kind === DENOISE
    ? [[section(man, 'guidance').unet_batch, lat.channels, lat.height, lat.width], 'guidance.unet_batch x latent']
    : stage.kind === ENCODE_IMAGE ? [[1, lat.channels, lat.height, lat.width], 'latent']
      : [[1, image.channels, image.height, image.width], 'image'];
  if (!same(got, want)) found.push(`components.${stage.component}.outputs: ${named(stage, stage.component)}: shape ${JSON.stringify(got)}, but ${what} gives ${JSON.stringify(want)}`);
}

// ------------------------------------------------------------------------------- guidance (runtime/guidance.py)

/** Classifier-free guidance as one declared step (the manifest's `guidance` block): `cfg` (unet_batch 2) encodes the
 *  prompt and the empty prompt, the UNet's batch is [unconditional, conditional] and its output
 *  out[0] + scale * (out[1] - out[0]); `embedded` and `none` (unet_batch 1) run the prompt alone. Tensors are
 *  {data: Float32Array, shape}. `scale`: the page's (its guidance field), else the block's. */
export class Guidance {
  /** zeroUnconditional: the manifest's pipeline.conditioning.zero_unconditional (runtime/guidance.py's rule). */
  constructor(block, scale = block.scale, zeroUnconditional = false) {
    this.mode = String(block.mode);
    this.scale = Number(scale);
    this.batch = Number(block.unet_batch);
    this.zeroUnconditional = Boolean(zeroUnconditional);
  }

  /** Whether the empty prompt is encoded too (its row goes first in the UNet's batch); not when its rows are zeros. */
  get unconditional() {
    return this.batch === 2 && !this.zeroUnconditional;
  }

  /** The prompts each encode stage runs on, in order: the prompt, then (cfg) the empty prompt. */
  prompts(prompt) {
    return this.unconditional ? [prompt, ''] : [prompt];
  }

  /** A prompt role's rows (in `prompts` order) as the UNet's batch: [uncond, cond] for cfg. */
  stack(rows) {
    if (this.batch === 2 && this.zeroUnconditional) {
      const cond = rows[0]; // [zeros, cond]: a Float32Array starts zeroed
      const data = new Float32Array(2 * cond.data.length);
      data.set(cond.data, cond.data.length);
      return { data, shape: [2 * cond.shape[0], ...cond.shape.slice(1)] };
    }
    if (rows.length === 1) return rows[0];
    const [cond, uncond] = rows;
    const data = new Float32Array(uncond.data.length + cond.data.length);
    data.set(uncond.data, 0);
    data.set(cond.data, uncond.data.length);
    return { data, shape: [uncond.shape[0] + cond.shape[0], ...cond.shape.slice(1)] };
  }

  /** A per-sample value ([1, ...]) repeated to the UNet's batch. */
  repeat(x) {
    if (this.batch === 1) return x;
    const n = x.data.length;
    const data = new Float32Array(this.batch * n);
    for (let b = 0; b < this.batch; b++) data.set(x.data, b * n);
    return { data, shape: [this.batch * x.shape[0], ...x.shape.slice(1)] };
  }

  /** The UNet's batch output (its data) as the scheduler's model output. */
  combine(out) {
    if (this.batch !== 2) return out;
    const n = out.length / 2;
    const res = new Float32Array(n);
    for (let k = 0; k < n; k++) res[k] = out[k] + this.scale * (out[n + k] - out[k]);
    return res;
  }
}

/** Two prompt-role tensors [rows, ..., a] and [rows, ..., b] joined on the last axis (two encoders' outputs). */
export function concatLast(a, b) {
  const wa = a.shape[a.shape.length - 1], wb = b.shape[b.shape.length - 1], rows = a.data.length / wa;
  const data = new Float32Array(rows * (wa + wb));
  for (let r = 0; r < rows; r++) {
    data.set(a.data.subarray(r * wa, (r + 1) * wa), r * (wa + wb));
    data.set(b.data.subarray(r * wb, (r + 1) * wb), r * (wa + wb) + wa);
  }
  return { data, shape: [...a.shape.slice(0, -1), wa + wb] };
}
