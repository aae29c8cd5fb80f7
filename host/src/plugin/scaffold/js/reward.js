// {{name}}: a reward (it scores finished trajectories into named components), in
// JavaScript built into a WebAssembly component by componentize-qjs (QuickJS). This one
// gives `format` (the completion answers in <answer>…</answer>) and `correct` (that answer
// is the sample's `answer` from its metadata; 0 when the sample has none). Replace the
// scoring with yours; the run config weighs the components.
//
// Config (JSON): {"tag": "answer"} (optional): the tag the answer is written in.

class Scorer {
  static open(config) {
    const { tag } = parseConfig(config, { tag: "answer" });
    if (typeof tag !== "string" || tag === "" || /[<>/]/.test(tag)) {
      throw '{{name}} config: `tag` must be a tag name such as "answer"';
    }
    const scorer = new Scorer();
    scorer.openTag = `<${tag}>`;
    scorer.closeTag = `</${tag}>`;
    return scorer;
  }

  score(trajectory) {
    const text = trajectory.completion;
    let given = null;
    const end = text.lastIndexOf(this.closeTag);
    if (end !== -1) {
      const start = text.lastIndexOf(this.openTag, end);
      if (start !== -1) {
        given = text.slice(start + this.openTag.length, end).trim();
      }
    }
    let metadata;
    try {
      metadata = JSON.parse(trajectory.metadata);
    } catch (e) {
      throw `{{name}}: the sample's metadata is not JSON: ${e.message}`;
    }
    const answer = metadata?.answer;
    const expected = answer === undefined || answer === null ? null : String(answer).trim();
    return [
      { name: "format", value: given !== null ? 1.0 : 0.0 },
      { name: "correct", value: given !== null && given === expected ? 1.0 : 0.0 },
    ];
  }
}

export const reward = { Scorer };
