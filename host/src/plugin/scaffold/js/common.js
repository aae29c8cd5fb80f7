
/// The JSON object `config` over `defaults`; unknown fields and bad JSON are errors
/// (thrown strings become the WIT `result`'s error).
function parseConfig(config, defaults) {
  let parsed;
  try {
    parsed = JSON.parse(config || "{}");
  } catch (e) {
    throw `{{name}} config is not JSON: ${e.message}`;
  }
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
    throw "{{name}} config must be a JSON object";
  }
  const unknown = Object.keys(parsed).filter((k) => !(k in defaults)).sort();
  if (unknown.length > 0) {
    throw `{{name}} config: unknown field \`${unknown[0]}\`, expected one of ${Object.keys(defaults).join(", ")}`;
  }
  return { ...defaults, ...parsed };
}

/// A chat message from `role`: every field of WIT's `message` must be there (none is
/// optional in a record), the tool-call ones empty.
function message(role, content) {
  return { role, content, toolCalls: [], toolCallId: null };
}

export const about = {
  info() {
    return { name: "{{name}}", version: "0.1.0", description: "{{description}}" };
  },
};
