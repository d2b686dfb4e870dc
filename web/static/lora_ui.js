// The page's LoRA controls (index.html #lora), shown only for a bundle exported with lora_slots: a .safetensors picked
// (or ?lora=URL&lora_scale=S) is read and checked against the slots at once (lora.js: one line naming the first key at
// fault, the previous LoRA kept), and fed to the UNet per image (generate.js opts.lora): swapping LoRAs between images
// changes the factor inputs only, no model reloaded or recompiled. No LoRA: zero factors.
import { BundleError } from './stages.js';
import { loraFeeds } from './lora.js';

export class LoraControls {
  /** `$`: the page's getElementById; `man`: the opened bundle's manifest. */
  constructor($, man) {
    this.$ = $;
    this.man = man;
    this.enabled = !!man.lora_slots && typeof man.lora_slots === 'object';
    this.lora = null; // {bytes, name} of the LoRA in use
    this.source = null; // its URL (?lora=) or the picked file's name
    $('lora').hidden = !this.enabled;
    if (!this.enabled) return;
    $('lora-note').textContent = `LoRA slots: rank ${man.lora_slots.rank} on ${man.lora_slots.targets.length} attention projections of the UNet.`;
    $('lora-file').addEventListener('change', (ev) => this.pick(ev.target.files?.[0]));
    $('lora-clear').addEventListener('click', () => this.set(null, null));
  }

  scale() {
    return Number(this.$('lora-scale').value);
  }

  /** Use `lora` ({bytes, name}; null: none) from `source`, refused (BundleError) when it does not fit the slots. */
  set(lora, source) {
    if (lora) loraFeeds(this.man, { ...lora, scale: this.scale() }); // LoraError: one line, the previous LoRA kept
    this.lora = lora;
    this.source = source;
    this.$('lora-name').textContent = lora ? lora.name : 'none (zero factors)';
  }

  async pick(file) {
    if (!file) return;
    try {
      this.set({ bytes: new Uint8Array(await file.arrayBuffer()), name: file.name }, file.name);
    } catch (e) {
      this.$('lora-name').textContent = `${file.name} refused: ${e.message}`;
    }
  }

  /** ?lora=URL&lora_scale=S (check mode): a scale without a LoRA, a LoRA for a bundle without slots, refused. */
  async fromParams(params, base) {
    const url = params.get('lora'), scale = params.get('lora_scale');
    if (!url) {
      if (scale !== null) throw new BundleError(`lora_scale=${scale}: only with lora=URL`);
      return;
    }
    if (!this.enabled) throw new BundleError(`lora=${url}: the bundle has no LoRA slots (export it with lora_slots: {rank: 4, targets: [attn]})`);
    if (scale !== null) {
      if (!(scale.trim() !== '' && Number.isFinite(Number(scale)))) throw new BundleError(`lora_scale=${scale}: not a finite number`);
      this.$('lora-scale').value = scale;
    }
    const href = new URL(url, base).href, res = await fetch(href);
    if (!res.ok) throw new BundleError(`lora ${href}: could not be read (HTTP ${res.status})`);
    this.set({ bytes: new Uint8Array(await res.arrayBuffer()), name: href }, href);
  }

  /** generate.js's opts.lora (null: zero factors). */
  input() {
    return this.lora ? { ...this.lora, scale: this.scale() } : null;
  }

  describe() {
    return this.lora ? { lora: this.source, scale: this.scale() } : null;
  }
}

/** Why this run's LoRA is not the reference's (reference.json lora, lora_scale), or null when it is. */
export function loraMismatch(ref, controls, base) {
  const want = ref.lora ? { lora: new URL(`reference/${ref.lora}`, base).href, scale: ref.lora_scale } : null;
  const got = controls?.describe() ?? null;
  if (JSON.stringify(want) === JSON.stringify(got)) return null;
  const say = (v) => (v ? `LoRA ${v.lora} at scale ${v.scale}` : 'no LoRA');
  return `the reference is made with ${say(want)}; this run with ${say(got)}`;
}
