// A model exported in chunks (export `unet_chunks: K`, `text_encoder_chunks: K`, manifest schema_version 2, or 3
// with its pipeline block), as run-bundle runs it (runtime/chunks.py). `base` names the model: a chunkable component
// of the registry (stages.js CHUNKABLE: the UNet, the text encoder), the component of a pipeline stage; its block
// is the manifest's `<base>_chunks`. <base>.0 ... <base>.K-1 run in sequence, a table of named tensors
// between them (the model's inputs first: the UNet's sample, timestep, encoder_hidden_states; the text
// encoder's input_ids; each chunk reads its inputs from it by name and writes its outputs into it:
// `hidden`, the stream; the UNet's `skip_J`, the down path's skip connections), then, per the block's
// `aliases`, a second name for one of its outputs (a UNet chunk ending with a down block returns that
// block's last skip only as `hidden`); the last chunk's one output is the model's output. A UNet with SDXL's added
// embedding: unet.0 reads `text_embeds` and `time_ids` (the model's inputs) and returns `emb` (the time embedding plus
// the added embedding), which later chunks read in place of `timestep`: fed by name like any other. A UNet with LoRA
// slots: the factors (lora.js loraFeeds, the whole UNet's inputs) start in the table; each chunk reads its own slots'.
// Errors here are plain Errors with the component or field named; pipeline.js turns a manifest problem
// (layoutProblem) into its BundleError.

import { CHUNKABLE, PIPELINE_SCHEMA_VERSION, REGISTRY, blockKey } from './stages.js';

export { CHUNKABLE, blockKey }; // the models a bundle may hold in chunks (the registry's; the UNet's layout checked first)
export const CHUNKED_SCHEMA_VERSION = 2;
const spoken = (base) => REGISTRY[base]?.spoken ?? base;
export const EMBEDDING = 'emb'; // runtime/chunks.py EMBEDDING: made by unet.0 of a UNet with the added embedding
const spokenInput = (name) => (name === EMBEDDING
  ? `${EMBEDDING} (the time embedding plus the added embedding of text_embeds and time_ids, which the first chunk computes and returns)` : name);

/** What is wrong with the manifest's layout of `base` (its `<base>_chunks` block, and the schema version
 *  that goes with it: 2 iff the manifest has a chunks block, or 3, whose pipeline block says, chunked or not), or null. */
export function partsProblem(man, base) {
  const key = blockKey(base);
  const block = man[key];
  if (!block) {
    if (CHUNKABLE.some((b) => man[blockKey(b)])) return null; // another model's block: its own check
    return man.schema_version === 1 || man.schema_version === PIPELINE_SCHEMA_VERSION ? null
      : `manifest.json: schema version ${man.schema_version} is not supported (expected 1, or ${CHUNKED_SCHEMA_VERSION} with ${CHUNKABLE.map(blockKey).join(' or ')}, or ${PIPELINE_SCHEMA_VERSION} with its pipeline block)`;
  }
  const parts = block.components;
  if (!Array.isArray(parts) || parts.length < 2 || parts.some((p, i) => p !== `${base}.${i}`)) {
    return `manifest: ${key}.components must list ${base}.0, ${base}.1, ... (at least two), got ${JSON.stringify(parts)}`;
  }
  if (man.schema_version !== CHUNKED_SCHEMA_VERSION && man.schema_version !== PIPELINE_SCHEMA_VERSION) {
    return `manifest.json: a bundle with ${key} has schema version ${CHUNKED_SCHEMA_VERSION}, got ${man.schema_version} (or ${PIPELINE_SCHEMA_VERSION}, with its pipeline block)`;
  }
  return null;
}

/** The first problem of the manifest's layout (each chunkable model's, CHUNKABLE's order), or null. */
export function layoutProblem(man) {
  for (const base of CHUNKABLE) {
    const problem = partsProblem(man, base);
    if (problem) return problem;
  }
  return null;
}

/** A model's component names in call order: [base], or its chunks base.0, base.1, ... (after partsProblem). */
export function modelParts(man, base) {
  const block = man[blockKey(base)];
  return block ? block.components.slice() : [base];
}

/** The names of a compiled chunk's outputs, in its run's order: the model's own names where they are the
 *  manifest's declared ones, else the manifest's order (the exporter writes them from the same signature). */
export function outputNames(component, declared) {
  const own = component.model.getOutputDetails().map((d) => d.name);
  const names = (declared || []).map((o) => o.name);
  if (own.length === names.length && own.every((n) => names.includes(n))) return own;
  if (own.length !== names.length) {
    throw new Error(`${component.name}: the model has ${own.length} outputs, the manifest declares ${names.length}`);
  }
  return names;
}

/** Per chunk of `base`, {alias: the chunk's output it names} ({} where the manifest has no aliases). */
export function chunkAliases(man, base) {
  const block = man[blockKey(base)] || {};
  const n = (block.components || []).length;
  return Array.isArray(block.aliases) && block.aliases.length === n ? block.aliases.map((a) => ({ ...a })) : Array.from({ length: n }, () => ({}));
}

/** For each of a model's outputs (`names`, in its run's order), the J of the golden's output_J: the
 *  manifest's declared order, which the exporter writes from the file's signature; LiteRT.js may return a
 *  chunk's outputs in another order (SD's unet.0 does). */
export function goldenIndices(names, declared) {
  const order = (declared || []).map((o) => o.name);
  return names.map((n) => {
    const j = order.indexOf(n);
    if (j < 0) throw new Error(`output ${n} is not among the manifest's declared outputs (${order.join(', ')})`);
    return j;
  });
}

/** One compiled chunk `c` of `base` run on its inputs from the table of named tensors (`tensors`, changed
 *  here): its outputs (`names`, in its run's order) and their `aliases` written back into the table;
 *  returns its outputs. */
export async function runChunk(tensors, c, names, aliases, base) {
  const mine = {};
  for (const d of c.model.getInputDetails()) {
    if (!(d.name in tensors)) throw new Error(`${c.name}: no earlier chunk (nor the ${spoken(base)}'s inputs) makes its input ${spokenInput(d.name)}`);
    mine[d.name] = tensors[d.name];
  }
  const outs = await c.runAll(mine);
  names.forEach((name, i) => { tensors[name] = outs[i]; });
  for (const [alias, src] of Object.entries(aliases || {})) {
    if (!names.includes(src)) throw new Error(`${c.name}: ${blockKey(base)}.aliases names ${src}, which it does not return`);
    tensors[alias] = tensors[src];
  }
  return outs;
}

/** A model's output {data, shape} from its parts (one whole model, or the chunks in sequence: compiled
 *  Components kept resident, or StreamedChunks compiled for this use and released after it);
 *  `outNames`: each part's output names (outputNames; found once, filled here for a streamed chunk);
 *  `aliases`: chunkAliases(man, base). */
export async function runParts(parts, feeds, outNames, aliases, base) {
  if (parts.length === 1 && !parts[0].open) return parts[0].run(feeds);
  const tensors = { ...feeds };
  let outs = [];
  for (const [k, part] of parts.entries()) {
    const c = part.open ? await part.open() : part;
    try {
      const names = outNames[k] ?? (outNames[k] = part.outputNames(c));
      outs = await runChunk(tensors, c, names, aliases[k], base);
    } finally {
      if (part.open) part.close();
    }
  }
  return outs[0];
}

/** Each feed's output {data, shape} through a model's parts opened one at a time (StreamedChunk's
 *  protocol: `open()` -> a compiled Component, `close()` releases what it compiled, called also when open
 *  or a run fails; `outputNames(c)`): part k runs on every feed before part k + 1 opens (a chunked text
 *  encoder on the prompt and the empty prompt, one chunk in memory, as run-bundle's _encode), each feed's
 *  tensors passed between the chunks by name as runParts passes them; one whole model runs on each feed.
 *  `aliases`: chunkAliases(man, base). `every`: each feed's every output, {outs, names} (the last part's, in its
 *  run's order), instead of its first. */
export async function runPartsOnEach(parts, feedsList, aliases, base, every = false) {
  const tables = feedsList.map((feeds) => ({ ...feeds }));
  let outs = [];
  for (const [k, part] of parts.entries()) {
    try {
      const c = await part.open();
      outs = [];
      const names = parts.length > 1 || every ? part.outputNames(c) : null;
      for (const tensors of tables) {
        const all = parts.length === 1 ? (every ? await c.runAll(tensors) : [await c.run(tensors)]) : await runChunk(tensors, c, names, aliases[k], base);
        outs.push(every ? { outs: all, names } : all[0]);
      }
    } finally {
      part.close();
    }
  }
  return outs;
}

/** A chunk compiled for each use and released right after it (the page's `unet=streamed`): the chunks
 *  of an SD-size UNet do not fit LiteRT.js's 2 GB wasm heap together, one at a time they do. The fetched
 *  bytes stay in the page; `compile(fetched)` -> a Component; its compile and run times are gathered here. */
export class StreamedChunk {
  constructor(fetched, compile, declaredOutputs) {
    this.fetched = fetched;
    this.compile = compile;
    this.declared = declaredOutputs;
    this.name = fetched.name;
    this.current = null;
    this.compiles = 0;
    this.compileMsAll = [];
    this.runMs = [];
  }

  async open() {
    const c = await this.compile(this.fetched);
    this.current = c;
    this.compiles += 1;
    this.compileMsAll.push(c.compileMs);
    return c;
  }

  close() {
    if (!this.current) return;
    this.runMs.push(...this.current.runMs);
    this.current.release();
    this.current = null;
  }

  outputNames(c) {
    return outputNames(c, this.declared);
  }
}
