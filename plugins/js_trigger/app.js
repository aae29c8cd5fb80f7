// The JavaScript code tool, built into a WebAssembly component by componentize-qjs
// (QuickJS): the JavaScript twin of the Python `code_trigger`.
//
// The model writes a fenced ```js block; when the closing fence is generated, the host
// calls `fire`, this plugin runs the block and returns what it logged, the value of the
// last expression (as a REPL shows it) or the error, inside <output>…</output>. It runs in
// rlhost's sandbox: no files, no network, no environment, a memory cap and a deadline, so
// an endless loop or a memory bomb in model-written code ends the call, never the run.
//
// State: the host opens one instance per trajectory, so the globals of one instance are
// one trajectory's. Blocks run as global code, and their top-level `let`, `const` and
// `class` declarations are kept for the blocks after (as in Node's REPL), so a block can
// use what an earlier one defined. Promises' callbacks do not run (there is no event loop).
//
// Config (JSON, all optional): {"max_output_chars": 2000}.

const FENCE = "```";
const LANGUAGES = new Set(["js", "javascript", "node"]);
const DEFAULTS = { max_output_chars: 2000 };

class Session {
  static open(config, _sample) {
    let parsed;
    try {
      parsed = JSON.parse(config || "{}");
    } catch (e) {
      throw `js_trigger config is not JSON: ${e.message}`;
    }
    if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
      throw "js_trigger config must be a JSON object";
    }
    const unknown = Object.keys(parsed).filter((k) => !(k in DEFAULTS)).sort();
    if (unknown.length > 0) {
      throw `js_trigger config: unknown field \`${unknown[0]}\`, expected one of ${JSON.stringify(Object.keys(DEFAULTS))}`;
    }
    const max = parsed.max_output_chars ?? DEFAULTS.max_output_chars;
    if (!Number.isInteger(max) || max < 1) {
      throw "js_trigger config: `max_output_chars` must be a positive integer";
    }
    const session = new Session();
    session.maxOutputChars = max;
    return session;
  }

  stopPatterns() {
    return [FENCE];
  }

  fire(text) {
    const code = closedBlock(text);
    if (code === null) {
      return null;
    }
    let output = wellFormed(run(code));
    if (output.length > this.maxOutputChars) {
      const cut = output.length - this.maxOutputChars;
      output = `${output.slice(0, this.maxOutputChars)}\n...[${cut} more characters]\n`;
    }
    // A fence in the output would unbalance the fences the host and this plugin count.
    output = output.replaceAll(FENCE, "'''");
    if (output && !output.endsWith("\n")) {
      output += "\n";
    }
    return `\n<output>\n${output}</output>\n`;
  }
}

/// The code of the js block that `text`'s last fence closes, or null if that fence opens a
/// block (or closes one in another language).
function closedBlock(text) {
  if (!text.endsWith(FENCE) || text.split(FENCE).length % 2 === 0) {
    return null;
  }
  const start = text.lastIndexOf(FENCE, text.length - 2 * FENCE.length);
  const headerEnd = text.indexOf("\n", start);
  if (start < 0 || headerEnd === -1 || headerEnd > text.length - FENCE.length) {
    return null;
  }
  const language = text.slice(start + FENCE.length, headerEnd).trim().toLowerCase();
  if (!LANGUAGES.has(language)) {
    return null;
  }
  return text.slice(headerEnd + 1, text.length - FENCE.length);
}

/// Runs `code` as global code; returns what it logged, then the value of the last
/// expression statement or the error.
function run(code) {
  const lines = [];
  // Returns nothing, as Node's does: a last `console.log(...)` shows no value.
  const log = (...args) => {
    lines.push(args.map((a) => show(a, 0, false, new Set())).join(" "));
  };
  globalThis.console = { log, info: log, warn: log, error: log, debug: log, trace: log };
  try {
    // Indirect eval: global scope; its completion value is the last statement's.
    const value = (0, eval)(scan(code));
    if (value !== undefined) {
      lines.push(show(value, 0, true, new Set()));
    }
  } catch (e) {
    lines.push(describeError(e));
  }
  return lines.join("\n");
}

function describeError(e) {
  if (e instanceof Error) {
    const where = (e.stack || "")
      .split("\n")
      .filter((l) => l.includes("<input>"))
      .map((l) => l.replace(/^\s*/, "    "));
    return [`Uncaught ${e.name}: ${e.message}`, ...where].join("\n");
  }
  return `Uncaught ${show(e, 0, true, new Set())}`;
}

/// Lone surrogates as U+FFFD: a WIT string must be valid Unicode.
function wellFormed(s) {
  return s.replace(/[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/g, "\ufffd");
}

/// `code` with its top-level `let`/`const` declarations as `var` and its top-level
/// `class X` as `var X = class X`, so that they outlive the eval (global lexical
/// declarations of an indirect eval are its own). Strings, templates, comments and regular
/// expressions are skipped; anything nested in braces, brackets or parentheses is left as
/// it is. Line numbers are kept, so errors point at the model's line.
function scan(code) {
  let out = "";
  let depth = 0;
  let i = 0;
  let lastSignificant = "";
  let classEnds = false; // the next `}` back at depth 0 ends a rewritten class
  const isIdent = (c) => c !== undefined && /[A-Za-z0-9_$]/.test(c);
  while (i < code.length) {
    const c = code[i];
    const next = code[i + 1];
    if (c === "/" && next === "/") {
      const end = code.indexOf("\n", i);
      const stop = end === -1 ? code.length : end;
      out += code.slice(i, stop);
      i = stop;
      continue;
    }
    if (c === "/" && next === "*") {
      const end = code.indexOf("*/", i + 2);
      const stop = end === -1 ? code.length : end + 2;
      out += code.slice(i, stop);
      i = stop;
      continue;
    }
    if (c === '"' || c === "'" || c === "`" || (c === "/" && startsRegex(lastSignificant))) {
      const stop = skipQuoted(code, i);
      out += code.slice(i, stop);
      i = stop;
      lastSignificant = "a";
      continue;
    }
    if (depth === 0 && !isIdent(code[i - 1]) && (c === "l" || c === "c")) {
      const word = /^(let|const|class)(?![A-Za-z0-9_$])/.exec(code.slice(i, i + 6));
      if (word && atStatementStart(lastSignificant)) {
        if (word[1] === "class") {
          const name = /^class\s+([A-Za-z_$][A-Za-z0-9_$]*)/.exec(code.slice(i));
          if (name) {
            out += `var ${name[1]} = class`;
            classEnds = true;
            i += "class".length;
            lastSignificant = "=";
            continue;
          }
        } else {
          out += "var";
          i += word[1].length;
          lastSignificant = "a";
          continue;
        }
      }
    }
    if (c === "{" || c === "(" || c === "[") {
      depth += 1;
    } else if (c === "}" || c === ")" || c === "]") {
      depth -= 1;
      if (depth === 0 && c === "}" && classEnds) {
        classEnds = false;
        out += "};";
        i += 1;
        lastSignificant = ";";
        continue;
      }
    }
    out += c;
    if (!/\s/.test(c)) {
      lastSignificant = isIdent(c) ? "a" : c;
    }
    i += 1;
  }
  return out;
}

function atStatementStart(last) {
  return last === "" || last === ";" || last === "}" || last === "{";
}

/// Whether a `/` after `last` (the last significant character) starts a regular expression.
function startsRegex(last) {
  return last === "" || "(,=:[!&|?{};+-*%<>~^".includes(last);
}

/// The index just past the string, template or regular expression starting at `i`.
function skipQuoted(code, i) {
  const quote = code[i];
  let j = i + 1;
  let braces = 0;
  let inClass = false;
  while (j < code.length) {
    const c = code[j];
    if (c === "\\") {
      j += 2;
      continue;
    }
    if (quote === "`") {
      if (c === "$" && code[j + 1] === "{") {
        braces += 1;
        j += 2;
        continue;
      }
      if (braces > 0) {
        if (c === "}") braces -= 1;
        j += 1;
        continue;
      }
    }
    if (quote === "/") {
      if (c === "[") inClass = true;
      else if (c === "]") inClass = false;
      else if (c === "/" && !inClass) {
        j += 1;
        while (j < code.length && /[a-z]/.test(code[j])) j += 1;
        return j;
      }
      if (c === "\n") return j;
      j += 1;
      continue;
    }
    if (c === quote) return j + 1;
    if (c === "\n" && quote !== "`") return j;
    j += 1;
  }
  return j;
}

/// A value as Node's console shows it (strings quoted when nested or shown as a result).
function show(v, depth, quoteStrings, seen) {
  switch (typeof v) {
    case "string":
      return quoteStrings ? `'${v.replaceAll("\\", "\\\\").replaceAll("'", "\\'").replaceAll("\n", "\\n")}'` : v;
    case "number":
      return Object.is(v, -0) ? "-0" : String(v);
    case "bigint":
      return `${v}n`;
    case "undefined":
      return "undefined";
    case "boolean":
    case "symbol":
      return String(v);
    case "function":
      return v.name ? `[Function: ${v.name}]` : "[Function (anonymous)]";
  }
  if (v === null) return "null";
  if (seen.has(v)) return "[Circular]";
  if (v instanceof Error) return v.stack ? `${v.name}: ${v.message}` : String(v);
  if (v instanceof Date) return isNaN(v) ? "Invalid Date" : v.toISOString();
  if (v instanceof RegExp) return String(v);
  if (depth > 2) return Array.isArray(v) ? "[Array]" : "[Object]";
  seen.add(v);
  const inner = (x) => show(x, depth + 1, true, seen);
  let text;
  if (Array.isArray(v)) {
    const items = v.slice(0, 100).map(inner);
    if (v.length > 100) items.push(`... ${v.length - 100} more items`);
    text = items.length ? `[ ${items.join(", ")} ]` : "[]";
  } else if (v instanceof Map) {
    const items = [...v].map(([k, x]) => `${inner(k)} => ${inner(x)}`);
    text = `Map(${v.size}) ${items.length ? `{ ${items.join(", ")} }` : "{}"}`;
  } else if (v instanceof Set) {
    const items = [...v].map(inner);
    text = `Set(${v.size}) ${items.length ? `{ ${items.join(", ")} }` : "{}"}`;
  } else {
    const items = Object.keys(v).map((k) => {
      const key = /^[A-Za-z_$][A-Za-z0-9_$]*$/.test(k) ? k : `'${k}'`;
      return `${key}: ${inner(v[k])}`;
    });
    text = items.length ? `{ ${items.join(", ")} }` : "{}";
  }
  seen.delete(v);
  return text;
}

export const trigger = { Session };

export const about = {
  info() {
    return {
      name: "js_trigger",
      version: "0.1.0",
      description: "Runs ```js blocks the model writes (QuickJS), returns <output>...</output>",
    };
  },
};
