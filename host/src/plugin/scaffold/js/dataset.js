// {{name}}: a dataset (a source of task samples), in JavaScript built into a WebAssembly
// component by componentize-qjs (QuickJS). This one makes addition problems whose answer
// is in the sample's metadata. Replace the problems with yours; keep each sample a
// function of the seed and the index alone, so that runs repeat and resume exactly.
//
// Config (JSON): {"size": 1000} (optional): how many samples there are.

/// SplitMix64 (on BigInt: WIT's u64 arrives as a number, exact below 2^53).
function mix(z) {
  const M = (1n << 64n) - 1n;
  z = (z + 0x9e3779b97f4a7c15n) & M;
  z = ((z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n) & M;
  z = ((z ^ (z >> 27n)) * 0x94d049bb133111ebn) & M;
  return z ^ (z >> 31n);
}

class Source {
  static open(config, seed) {
    const { size } = parseConfig(config, { size: 1000 });
    if (!Number.isInteger(size) || size < 1) {
      throw "{{name}} config: `size` must be an integer of at least 1";
    }
    const source = new Source();
    source.size = size;
    source.seed = BigInt(seed);
    return source;
  }

  len() {
    return this.size;
  }

  get(index) {
    if (index >= this.size) {
      throw `index ${index} is past the ${this.size} samples`;
    }
    const r = mix(this.seed ^ mix(BigInt(index)));
    const a = Number(r % 1000n);
    const b = Number((r >> 32n) % 1000n);
    return {
      messages: [message("user", `What is ${a} + ${b}? Answer as <answer>N</answer>.`)],
      metadata: JSON.stringify({ answer: a + b }),
    };
  }
}

export const dataset = { Source };
