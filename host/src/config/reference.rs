//! The configuration reference, generated from the config types: each key's doc comment,
//! type and default come from the types' JSON schema (derived by `schemars` from the same
//! structs serde reads the file into), its allowed range from the range table
//! ([`super::ranges`]). `rlhost config reference` prints it; the book includes its
//! Markdown form, which a test keeps equal to what this module prints, so the reference
//! cannot drift from what the code reads.

use super::RunConfig;
use serde_json::{Map, Value};
use std::fmt::Write;

/// One key of the config file.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Its section as written in the file: `[train]`, `[plugins.NAME]`, `[[rewards]]`.
    pub section: String,
    /// Its full dotted name: `train.lr`, `plugins.NAME.path`, `rewards[].weights`.
    pub key: String,
    /// What kind of value it takes: `number`, `"grpo" | "ppo"`, `array of string`, ….
    pub kind: String,
    /// The value a file without the key gets, in TOML; `None` when the key is required or
    /// unset means off.
    pub default: Option<String>,
    /// True when a file must set it.
    pub required: bool,
    /// The range a number must be in, or the choices of a name with what each does.
    pub allowed: Option<String>,
    /// What it does (the field's doc comment).
    pub doc: String,
    /// A value to write: the doc's own example, else the default.
    pub example: Option<String>,
}

/// Every key of the config file, section by section in the file's order.
pub fn entries() -> Vec<Entry> {
    let schema = serde_json::to_value(schemars::schema_for!(RunConfig)).expect("a schema is JSON");
    let defs = schema["$defs"].as_object().cloned().unwrap_or_default();
    let walk = Walk {
        defs: &defs,
        ranges: super::ranges::allowed(),
    };
    let mut out = Vec::new();
    for (name, field) in properties(&schema) {
        // An optional section (`[gateway]`) documents the table it holds.
        let field = walk.unwrap_optional(field);
        if let Some(items) = field.get("items") {
            // `[[rewards]]`: an array of tables.
            let table = walk.resolve(items);
            walk.table(
                &format!("[[{name}]]"),
                &format!("{name}[]"),
                table,
                &mut out,
            );
        } else if let Some(values) = field.get("additionalProperties").filter(|v| v.is_object()) {
            // `[plugins.NAME]`: a table of tables, keyed by the user's names.
            let table = walk.resolve(values);
            let prefix = format!("{name}.NAME");
            walk.table(&format!("[{prefix}]"), &prefix, table, &mut out);
        } else {
            walk.table(&format!("[{name}]"), name, field, &mut out);
        }
    }
    out
}

struct Walk<'a> {
    defs: &'a Map<String, Value>,
    ranges: std::collections::BTreeMap<String, String>,
}

impl Walk<'_> {
    /// The schema a `$ref` points at, else the schema itself.
    fn resolve<'v>(&'v self, schema: &'v Value) -> &'v Value {
        match schema.get("$ref").and_then(Value::as_str) {
            Some(r) => {
                let name = r.rsplit('/').next().unwrap_or(r);
                self.defs.get(name).unwrap_or(schema)
            }
            None => schema,
        }
    }

    /// The schema without the `null` of an `Option`.
    fn unwrap_optional<'v>(&'v self, schema: &'v Value) -> &'v Value {
        if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
            let not_null: Vec<&Value> = any.iter().filter(|s| s["type"] != "null").collect();
            if not_null.len() == 1 {
                return self.resolve(not_null[0]);
            }
        }
        self.resolve(schema)
    }

    /// The keys of one table; a field that is itself a table of known keys (`[rollout.vllm]`)
    /// is a section of its own, after this one's keys.
    fn table(&self, section: &str, prefix: &str, schema: &Value, out: &mut Vec<Entry>) {
        let required = required_of(schema);
        let mut nested = Vec::new();
        for (name, field) in properties(schema) {
            let key = format!("{prefix}.{name}");
            let target = self.unwrap_optional(field);
            if target.get("properties").is_some() {
                nested.push((format!("[{key}]"), key, target));
                continue;
            }
            out.push(self.entry(section, key, field, required.contains(&name.as_str())));
        }
        for (section, key, schema) in nested {
            self.table(&section, &key, schema, out);
        }
    }

    fn entry(&self, section: &str, key: String, field: &Value, required: bool) -> Entry {
        let target = self.unwrap_optional(field);
        let doc = field["description"]
            .as_str()
            .or_else(|| target["description"].as_str().filter(|_| !is_enum(target)))
            .unwrap_or("")
            .replace('\n', " ");
        let default = field
            .get("default")
            .filter(|d| !d.is_null())
            .map(toml_value);
        let example = field["examples"]
            .as_array()
            .and_then(|e| e.first())
            .map(toml_value)
            .or_else(|| default.clone());
        let allowed = self
            .ranges
            .get(&key)
            .cloned()
            .or_else(|| choices(target).map(|c| c.join("; ")));
        Entry {
            section: section.to_string(),
            kind: self.kind(field),
            key,
            default,
            required,
            allowed,
            doc,
            example,
        }
    }

    /// A value's kind in words.
    fn kind(&self, schema: &Value) -> String {
        let schema = self.unwrap_optional(schema);
        if let Some(values) = enum_values(schema) {
            return values
                .iter()
                .map(|v| format!("\"{v}\""))
                .collect::<Vec<_>>()
                .join(" | ");
        }
        let types: Vec<&str> = match &schema["type"] {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts
                .iter()
                .filter_map(Value::as_str)
                .filter(|t| *t != "null")
                .collect(),
            _ => vec![],
        };
        match types.as_slice() {
            ["array"] => format!("array of {}", self.kind(&schema["items"])),
            ["object"] => "table".into(),
            ["integer"] => "integer".into(),
            ["number"] => "number".into(),
            ["string"] => "string".into(),
            ["boolean"] => "boolean".into(),
            [] => "any value".into(),
            more => more.join(" or "),
        }
    }
}

fn properties(schema: &Value) -> Vec<(&String, &Value)> {
    schema["properties"]
        .as_object()
        .map(|p| p.iter().collect())
        .unwrap_or_default()
}

fn required_of(schema: &Value) -> Vec<&str> {
    schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn is_enum(schema: &Value) -> bool {
    enum_values(schema).is_some()
}

/// The names an enum takes (serde's spelling), if the schema is one.
fn enum_values(schema: &Value) -> Option<Vec<String>> {
    if let Some(values) = schema["enum"].as_array() {
        return Some(
            values
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect(),
        );
    }
    let variants = schema["oneOf"].as_array()?;
    variants
        .iter()
        .map(|v| {
            v["const"]
                .as_str()
                .or_else(|| v["enum"].as_array()?.first()?.as_str())
                .map(str::to_string)
        })
        .collect()
}

/// An enum's names with what each does (its variants' doc comments), when they have them.
fn choices(schema: &Value) -> Option<Vec<String>> {
    let variants = schema["oneOf"].as_array()?;
    let names = enum_values(schema)?;
    Some(
        names
            .iter()
            .zip(variants)
            .map(|(name, v)| match v["description"].as_str() {
                Some(doc) => format!(
                    "`\"{name}\"`: {}",
                    doc.replace('\n', " ").trim_end_matches('.')
                ),
                None => format!("`\"{name}\"`"),
            })
            .collect(),
    )
}

/// A JSON value written as TOML writes it (inline).
fn toml_value(v: &Value) -> String {
    match v {
        Value::Null => "none".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => match n.as_f64() {
            // `1.0`, not `1`: a float key written as an integer is still read as a float,
            // but the reference shows the type it is.
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 1e15 => format!("{f:.1}"),
            Some(f) if n.is_f64() && f != 0.0 && f.abs() < 1e-3 => format!("{f:e}"),
            _ => n.to_string(),
        },
        Value::String(s) => format!("{s:?}"),
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(toml_value).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(fields) if fields.is_empty() => "{}".into(),
        Value::Object(fields) => format!(
            "{{ {} }}",
            fields
                .iter()
                .map(|(k, v)| format!("{k} = {}", toml_value(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The reference as text for a terminal: one block per key, grouped by section.
pub fn text(entries: &[Entry]) -> String {
    let mut out = String::new();
    let mut section = "";
    for e in entries {
        if e.section != section {
            section = &e.section;
            let _ = writeln!(out, "\n{section}");
        }
        let default = match (&e.default, e.required) {
            (_, true) => "required".to_string(),
            (Some(d), false) => format!("default {d}"),
            (None, false) => "optional".to_string(),
        };
        let _ = writeln!(out, "  {}  ({}; {default})", e.key, e.kind);
        if let Some(allowed) = &e.allowed {
            let _ = writeln!(out, "      allowed: {}", allowed.replace('`', ""));
        }
        let _ = writeln!(out, "      {}", e.doc.replace('`', ""));
        if let Some(example) = e
            .example
            .as_ref()
            .filter(|x| Some(*x) != e.default.as_ref())
        {
            let _ = writeln!(out, "      example: {} = {example}", last(&e.key));
        }
    }
    out.trim_start().to_string()
}

/// The reference as Markdown for the book: a table per section.
pub fn markdown(entries: &[Entry]) -> String {
    let mut out = String::from(
        "<!-- Generated by `rlhost config reference --markdown` from the config types' doc comments, \
         types and defaults; do not edit: change the code and regenerate. -->\n",
    );
    let mut section = "";
    for e in entries {
        if e.section != section {
            section = &e.section;
            let _ = write!(
                out,
                "\n### `{section}`\n\n| key | type | default | allowed | what it does | example |\n|---|---|---|---|---|---|\n"
            );
        }
        let default = match (&e.default, e.required) {
            (_, true) => "required".to_string(),
            (Some(d), false) => format!("`{d}`"),
            (None, false) => "unset".to_string(),
        };
        let cell = |s: &str| s.replace('|', "\\|");
        let example = e
            .example
            .as_ref()
            .map(|x| format!("`{} = {}`", last(&e.key), cell(x)))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} | {} |",
            e.key,
            cell(&e.kind),
            cell(&default),
            cell(e.allowed.as_deref().unwrap_or("")),
            cell(&e.doc),
            example
        );
    }
    out
}

fn last(key: &str) -> &str {
    key.rsplit('.').next().unwrap_or(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every key serde writes for a config with every section, plugin and reward entry
    /// filled in, as the reference names them.
    fn keys_in_code() -> BTreeSet<String> {
        let c: RunConfig = toml::from_str(
            "[model]\npath = \"m\"\n[data]\npath = \"d.jsonl\"\n[plugins.NAME]\npath = \"p.wasm\"\ngenerate = {}\n\
             [rollout.openenv]\n[rollout.tree]\n[gateway]\n[distill]\nteacher = \"t\"\n[[rewards]]\nplugin = \"NAME\"\n",
        )
        .unwrap();
        let mut keys = BTreeSet::new();
        fn walk(prefix: &str, v: &Value, keys: &mut BTreeSet<String>) {
            for (k, v) in v.as_object().into_iter().flatten() {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                match v {
                    // Tables of known keys (sections, `[rollout.vllm]`,
                    // `[rollout.openenv]` and its action mapping, `[rollout.tree]`, a plugin's `generate`
                    // grant); free-form tables (plugin configs, weights, template
                    // variables, an action's fixed fields) are one key.
                    Value::Object(_)
                        if prefix.is_empty()
                            || key == "rollout.vllm"
                            || key == "rollout.openenv"
                            || key == "rollout.openenv.action"
                            || key == "rollout.tree"
                            || key == "plugins.NAME.generate" =>
                    {
                        walk(&key, v, keys)
                    }
                    _ => {
                        keys.insert(key);
                    }
                }
            }
        }
        let mut v = serde_json::to_value(&c).unwrap();
        let plugins = v["plugins"]["NAME"].take();
        let rewards = v["rewards"][0].take();
        let o = v.as_object_mut().unwrap();
        o.remove("plugins");
        o.remove("rewards");
        walk("", &v, &mut keys);
        walk("plugins.NAME", &plugins, &mut keys);
        walk("rewards[]", &rewards, &mut keys);
        keys
    }

    #[test]
    fn the_reference_names_every_key_the_code_reads_and_no_other() {
        let documented: BTreeSet<String> = entries().into_iter().map(|e| e.key).collect();
        let in_code = keys_in_code();
        let missing: Vec<_> = in_code.difference(&documented).collect();
        let extra: Vec<_> = documented.difference(&in_code).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "not in the reference: {missing:?}; not in the code: {extra:?}"
        );
    }

    #[test]
    fn every_key_says_what_it_does_and_shows_a_value() {
        let entries = entries();
        assert!(entries.len() > 100, "{}", entries.len());
        let undocumented: Vec<&str> = entries
            .iter()
            .filter(|e| e.doc.trim().is_empty())
            .map(|e| e.key.as_str())
            .collect();
        assert!(
            undocumented.is_empty(),
            "keys without a doc comment: {undocumented:?}"
        );
        let no_example: Vec<&str> = entries
            .iter()
            .filter(|e| e.example.is_none() && !e.required)
            .map(|e| e.key.as_str())
            .collect();
        assert!(
            no_example.is_empty(),
            "optional keys with neither a default nor an example: {no_example:?}"
        );
        let lr = entries.iter().find(|e| e.key == "train.lr").unwrap();
        assert_eq!(lr.kind, "number");
        assert!(
            lr.allowed
                .as_deref()
                .unwrap()
                .starts_with("a finite number > 0"),
            "{lr:?}"
        );
        let algorithm = entries.iter().find(|e| e.key == "train.algorithm").unwrap();
        assert_eq!(algorithm.kind, "\"grpo\" | \"ppo\"");
        assert_eq!(algorithm.default.as_deref(), Some("\"grpo\""));
        let path = entries.iter().find(|e| e.key == "model.path").unwrap();
        assert!(path.required && path.section == "[model]", "{path:?}");
        let cases = entries.iter().find(|e| e.key == "rewards[].cases").unwrap();
        assert_eq!(cases.section, "[[rewards]]");
    }

    /// The book's copy (docs/src/config-reference.md) is what this module prints:
    /// regenerate it with `rlhost config reference --markdown > docs/src/config-reference.md`.
    #[test]
    fn the_books_reference_is_up_to_date() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../docs/src/config-reference.md");
        let book = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            book == markdown(&entries()),
            "{} is stale: run `cargo run -p rlhost -- config reference --markdown > docs/src/config-reference.md`",
            path.display()
        );
    }
}
