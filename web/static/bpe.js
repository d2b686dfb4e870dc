// CLIP byte-level BPE from a bundle's tokenizer.json (the HF `tokenizers` file export writes).
// Same steps as the Python runner (tokenizers' CLIP setup): NFC, whitespace collapsed,
// lowercase; CLIP's word regex; UTF-8 bytes mapped to printable characters; BPE with the
// `</w>` end-of-word suffix; <|startoftext|> ... <|endoftext|>, truncated to max_length - 2
// content tokens and padded with pad_id. Checked against the Python tokenizer by
// tests/web/test_bpe.py and, in the page's check mode, against the manifest's golden ids.

const WORD = /<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+/gu;

function bytesToUnicode() {
  const bs = [];
  for (let b = 0x21; b <= 0x7e; b++) bs.push(b);
  for (let b = 0xa1; b <= 0xac; b++) bs.push(b);
  for (let b = 0xae; b <= 0xff; b++) bs.push(b);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n);
      n++;
    }
  }
  const map = new Array(256);
  bs.forEach((b, i) => { map[b] = String.fromCodePoint(cs[i]); });
  return map;
}

export class ClipBpe {
  /** @param {object} tokenizerJson parsed tokenizer.json; @param {object} tok manifest.tokenizer */
  constructor(tokenizerJson, tok) {
    const model = tokenizerJson.model || {};
    if (model.type !== 'BPE' || !model.vocab || !model.merges) {
      throw new Error('tokenizer.json: not a BPE model with vocab and merges');
    }
    this.suffix = model.end_of_word_suffix || '';
    this.vocab = new Map(Object.entries(model.vocab));
    this.ranks = new Map();
    model.merges.forEach((m, i) => {
      const pair = Array.isArray(m) ? m : m.split(' ');
      this.ranks.set(pair[0] + '\u0000' + pair[1], i);
    });
    this.byteMap = bytesToUnicode();
    this.maxLength = tok.max_length;
    this.bos = tok.bos_id;
    this.eos = tok.eos_id;
    this.pad = tok.pad_id;
    this.cache = new Map();
  }

  normalize(text) {
    return text.normalize('NFC').replace(/\s+/gu, ' ').toLowerCase();
  }

  bpe(word) {
    if (this.cache.has(word)) return this.cache.get(word);
    let symbols = Array.from(word);
    if (symbols.length === 0) return [];
    symbols[symbols.length - 1] += this.suffix;
    while (symbols.length > 1) {
      let best = -1;
      let bestRank = Infinity;
      for (let i = 0; i < symbols.length - 1; i++) {
        const r = this.ranks.get(symbols[i] + '\u0000' + symbols[i + 1]);
        if (r !== undefined && r < bestRank) {
          bestRank = r;
          best = i;
        }
      }
      if (best < 0) break;
      const a = symbols[best];
      const b = symbols[best + 1];
      const merged = [];
      for (let i = 0; i < symbols.length; i++) {
        if (i < symbols.length - 1 && symbols[i] === a && symbols[i + 1] === b) {
          merged.push(a + b);
          i++;
        } else {
          merged.push(symbols[i]);
        }
      }
      symbols = merged;
    }
    this.cache.set(word, symbols);
    return symbols;
  }

  /** Content ids (no special tokens, no truncation). */
  encodeContent(text) {
    const ids = [];
    const enc = new TextEncoder();
    for (const m of this.normalize(text).matchAll(WORD)) {
      const word = Array.from(enc.encode(m[0]), (b) => this.byteMap[b]).join('');
      for (const sym of this.bpe(word)) {
        const id = this.vocab.get(sym);
        if (id === undefined) throw new Error(`tokenizer: symbol ${JSON.stringify(sym)} is not in the vocabulary`);
        ids.push(id);
      }
    }
    return ids;
  }

  /** {ids: Int32Array(max_length), tokens: content token count, truncated: tokens dropped} */
  encode(text) {
    const content = this.encodeContent(text);
    const keep = this.maxLength - 2;
    const kept = content.slice(0, keep);
    const ids = new Int32Array(this.maxLength).fill(this.pad);
    ids[0] = this.bos;
    ids.set(kept, 1);
    ids[kept.length + 1] = this.eos;
    return { ids, tokens: content.length, truncated: Math.max(0, content.length - keep) };
  }
}
