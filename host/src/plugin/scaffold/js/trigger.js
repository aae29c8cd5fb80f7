// {{name}}: a trigger (a tool the model calls in the middle of generation), in JavaScript
// built into a WebAssembly component by componentize-qjs (QuickJS). This one upper-cases
// what the model writes between <shout> and </shout> and returns it as <result>…</result>.
// Replace the tool with yours.
//
// Config (JSON): {"suffix": "!"} (optional) is appended to each result.

const OPEN = "<shout>";
const CLOSE = "</shout>";

/// One trajectory's session: it may keep state between the calls of that trajectory.
class Session {
  static open(config, _sample) {
    const { suffix } = parseConfig(config, { suffix: "" });
    if (typeof suffix !== "string") {
      throw "{{name}} config: `suffix` must be a string";
    }
    const session = new Session();
    session.suffix = suffix;
    return session;
  }

  stopPatterns() {
    return [CLOSE];
  }

  fire(text) {
    // The host fires when the text ends with a stop pattern; check anyway.
    if (!text.endsWith(CLOSE)) {
      return null;
    }
    const body = text.slice(0, -CLOSE.length);
    const start = body.lastIndexOf(OPEN);
    if (start === -1) {
      return null;
    }
    return `<result>${body.slice(start + OPEN.length).toUpperCase()}${this.suffix}</result>`;
  }
}

export const trigger = { Session };
