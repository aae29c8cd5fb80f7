// {{name}}: tools (functions the model calls in its own tool-call format), in JavaScript
// built into a WebAssembly component by componentize-qjs (QuickJS). This one has two:
// `add`, the sum of two integers (stateless), and `tally`, which adds an amount to the
// trajectory's running total and returns the total (it keeps state). Replace them with
// yours.
//
// In a run the host checks each call against the function's JSON Schema before it gets
// here; the checks below still refuse what does not fit (`rlhost plugin test` sends such
// calls), and a thrown string is the function's own refusal, which the model reads.
//
// Config (JSON): {"start": 0} (optional): the running total when a trajectory starts.

/// The largest magnitude of an argument and of the total.
const LIMIT = 1000000000;
const INTEGER = { type: "integer", minimum: -LIMIT, maximum: LIMIT };

const FUNCTIONS = [
  {
    name: "add",
    description: "The sum of two integers.",
    parameters: JSON.stringify({
      type: "object",
      properties: { a: INTEGER, b: INTEGER },
      required: ["a", "b"],
      additionalProperties: false,
    }),
    // Reads no state: its calls may run at once, each in a fresh instance.
    stateless: true,
  },
  {
    name: "tally",
    description: "Adds an amount to the running total and returns the total.",
    parameters: JSON.stringify({
      type: "object",
      properties: { amount: INTEGER },
      required: ["amount"],
      additionalProperties: false,
    }),
    stateless: false,
  },
];

/// `args` if it is an object with exactly these fields, else the refusal.
function fields(args, names) {
  if (args === null || typeof args !== "object" || Array.isArray(args)) {
    throw "bad arguments: expected a JSON object";
  }
  for (const name of Object.keys(args)) {
    if (!names.includes(name)) {
      throw `bad arguments: unknown field \`${name}\`, expected ${names.join(", ")}`;
    }
  }
  for (const name of names) {
    if (!(name in args)) {
      throw `bad arguments: missing field \`${name}\``;
    }
  }
  return args;
}

function integer(args, name, prefix = "") {
  const x = args[name];
  if (!Number.isInteger(x) || Math.abs(x) > LIMIT) {
    throw `${prefix}\`${name}\` must be an integer from -${LIMIT} to ${LIMIT}`;
  }
  return x;
}

/// One trajectory's session: its state lives as long as the trajectory.
class Session {
  static open(config, _sample) {
    const parsed = parseConfig(config, { start: 0 });
    const session = new Session();
    session.total = integer(parsed, "start", "{{name}} config: ");
    return session;
  }

  functions() {
    return FUNCTIONS;
  }

  call(name, argumentsJson) {
    let args;
    try {
      args = JSON.parse(argumentsJson);
    } catch (e) {
      throw `bad arguments: ${e.message}`;
    }
    if (name === "add") {
      fields(args, ["a", "b"]);
      return String(integer(args, "a") + integer(args, "b"));
    }
    if (name === "tally") {
      const amount = integer(fields(args, ["amount"]), "amount");
      const total = this.total + amount;
      if (Math.abs(total) > LIMIT) {
        throw `the total would leave -${LIMIT}..${LIMIT}; it stays ${this.total}`;
      }
      this.total = total;
      return String(total);
    }
    throw `there is no function \`${name}\``;
  }
}

export const tools = { Session };
