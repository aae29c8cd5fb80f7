// {{name}}: an environment (it answers each assistant turn), in JavaScript built into a
// WebAssembly component by componentize-qjs (QuickJS). This one keeps the model talking
// for a number of turns and rewards a last turn that says `done`. Replace the game with
// yours.
//
// Config (JSON): {"turns": 3} (optional): how many assistant turns an episode has.

/// One trajectory's episode.
class Episode {
  static open(config, _sample) {
    const { turns } = parseConfig(config, { turns: 3 });
    if (!Number.isInteger(turns) || turns < 1) {
      throw "{{name}} config: `turns` must be an integer of at least 1";
    }
    const episode = new Episode();
    episode.turns = turns;
    episode.turn = 0;
    return episode;
  }

  step(assistant) {
    this.turn += 1;
    if (this.turn >= this.turns) {
      const saidDone = assistant.toLowerCase().includes("done");
      return { messages: [], done: true, reward: saidDone ? 1.0 : 0.0 };
    }
    const left = this.turns - this.turn;
    const content = `You wrote ${[...assistant].length} characters. ${left} turns to go; say done in the last.`;
    return { messages: [message("user", content)], done: false, reward: null };
  }
}

export const environment = { Episode };
