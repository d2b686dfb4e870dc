// A UNet exported in chunks (export `unet_chunks: K`, manifest schema_version 2), as run-bundle runs it
// (runtime/chunks.py): unet.0 ... unet.K-1 in sequence, a table of named tensors between them (the
// UNet's inputs first; each chunk reads its inputs from it by name and writes its outputs into it:
// `hidden`, the stream; `skip_J`, the down path's skip connections), then, per `unet_chunks.aliases`, a
// second name for one of its outputs (a chunk ending with a down block returns that block's last skip only
// as `hidden`); the last chunk's one output is the UNet's output.
// Errors here are plain Errors with the component or field named; pipeline.js turns a manifest problem
// (unetPartsProblem) into its BundleError.

export const CHUNKED_SCHEMA_VERSION = 2;

/** What is wrong with the manifest's UNet layout (schema version, unet_chunks block), or null. */
export function unetPartsProblem(man) {
  const block = man.unet_chunks;
  if (!block) {
    return man.schema_version === 1 ? null
      : `manifest.json: schema version ${man.schema_version} is not supported (expected 1, or ${CHUNKED_SCHEMA_VERSION} with unet_chunks)`;
  }
  const parts = block.components;
  if (!Array.isArray(parts) || parts.length < 2 || parts.some((p, i) => p !== `unet.${i}`)) {
    return `manifest: unet_chunks.components must list unet.0, unet.1, ... (at least two), got ${JSON.stringify(parts)}`;
  }
  if (man.schema_version !== CHUNKED_SCHEMA_VERSION) {
    return `manifest.json: a bundle with unet_chunks has schema version ${CHUNKED_SCHEMA_VERSION}, got ${man.schema_version}`;
  }
  return null;
}

/** The UNet's component names in call order: ['unet'], or the chunks unet.0, unet.1, ... (after unetPartsProblem). */
export function unetParts(man) {
  return man.unet_chunks ? man.unet_chunks.components.slice() : ['unet'];
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

/** Per chunk, {alias: the chunk's output it names} ({} where the manifest has no aliases). */
export function chunkAliases(man) {
  const block = man.unet_chunks || {};
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

/** The UNet's output {data, shape} from its parts (one whole model, or the chunks in sequence: compiled
 *  Components kept resident, or StreamedChunks compiled for this use and released after it);
 *  `outNames`: each part's output names (outputNames; found once, filled here for a streamed chunk);
 *  `aliases`: chunkAliases(man). */
export async function runUnet(parts, feeds, outNames, aliases = []) {
  if (parts.length === 1 && !parts[0].open) return parts[0].run(feeds);
  const tensors = { ...feeds };
  let outs = [];
  for (const [k, part] of parts.entries()) {
    const c = part.open ? await part.open() : part;
    try {
      const mine = {};
      for (const d of c.model.getInputDetails()) {
        if (!(d.name in tensors)) throw new Error(`${c.name}: no earlier chunk (nor the UNet's inputs) makes its input ${d.name}`);
        mine[d.name] = tensors[d.name];
      }
      outs = await c.runAll(mine);
      const names = outNames[k] ?? (outNames[k] = part.outputNames(c));
      names.forEach((name, i) => { tensors[name] = outs[i]; });
      for (const [alias, src] of Object.entries(aliases[k] || {})) {
        if (!names.includes(src)) throw new Error(`${c.name}: unet_chunks.aliases names ${src}, which it does not return`);
        tensors[alias] = tensors[src];
      }
    } finally {
      if (part.open) part.close();
    }
  }
  return outs[0];
}

/** A UNet chunk compiled for each use and released right after it (the page's `unet=streamed`): the chunks
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
