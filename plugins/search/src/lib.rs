//! `search`: a tools plugin whose one function asks a retrieval service, as Search-R1's
//! and RL2's search tools do, through outbound HTTP the run grants.
//!
//! Config: `{"url": "http://127.0.0.1:8090", "k": 3}`: the service (one that answers
//! `GET /search?q=TEXT&k=N` with `{"hits": [{"title", "text"}, ...]}`, such as
//! `scripts/bm25_service.py`) and how many hits a call returns unless it asks for another
//! number. The run must grant the service: `[plugins.search] allow_http =
//! ["http://127.0.0.1:8090"]`; without it every call answers that the request was denied.
//!
//! The function `search(query, k)` is stateless (each call may run in a fresh instance, in
//! parallel with the turn's other calls) and answers with one line per hit, `[1] Title:
//! text`, or says that nothing matched. A service that cannot be reached or answers an
//! error is the function's error (the model reads it), not a fault.

use rlhost_sdk::{FunctionSpec, Sample, Tools};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    url: String,
    #[serde(default = "three")]
    k: u32,
}

fn three() -> u32 {
    3
}

struct Search {
    config: Config,
}

#[derive(Deserialize)]
struct Hits {
    hits: Vec<Hit>,
}

#[derive(Deserialize)]
struct Hit {
    title: String,
    text: String,
}

/// `s` percent-encoded for a query string (RFC 3986 unreserved characters kept).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

impl Tools for Search {
    fn open(config: &str, _sample: Sample) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("search config: {e}"))?;
        if !config.url.starts_with("http://") && !config.url.starts_with("https://") {
            return Err(format!(
                "search config: url {:?} is not http:// or https://",
                config.url
            ));
        }
        if !(1..=20).contains(&config.k) {
            return Err(format!("search config: k = {} is not in 1..=20", config.k));
        }
        Ok(Search { config })
    }

    fn functions(&self) -> Vec<FunctionSpec> {
        vec![FunctionSpec {
            name: "search".into(),
            description: "Searches the reference documents; returns the best matches, one per line.".into(),
            parameters: r#"{"type": "object", "properties": {
                "query": {"type": "string", "description": "What to look for, in a few words"},
                "k": {"type": "integer", "minimum": 1, "maximum": 10, "description": "How many documents"}
            }, "required": ["query"]}"#
                .into(),
            stateless: true,
        }]
    }

    fn call(&mut self, name: &str, arguments: &str) -> Result<String, String> {
        if name != "search" {
            return Err(format!("there is no function {name:?}"));
        }
        let args: serde_json::Value = serde_json::from_str(arguments).map_err(|e| e.to_string())?;
        let query = args["query"].as_str().unwrap_or_default().trim();
        if query.is_empty() {
            return Err("query is empty".into());
        }
        let k = args["k"].as_u64().map_or(self.config.k, |k| k as u32);
        let url = format!(
            "{}/search?q={}&k={k}",
            self.config.url.trim_end_matches('/'),
            encode(query)
        );
        let response =
            rlhost_sdk::http::get(&url).map_err(|e| format!("the search service: {e}"))?;
        if response.status != 200 {
            return Err(format!(
                "the search service answered {}: {}",
                response.status,
                response.text()
            ));
        }
        let hits: Hits = serde_json::from_slice(&response.body)
            .map_err(|e| format!("the search service's answer is not its JSON: {e}"))?;
        if hits.hits.is_empty() {
            return Ok(format!("no document matches {query:?}"));
        }
        Ok(hits
            .hits
            .iter()
            .enumerate()
            .map(|(i, h)| format!("[{}] {}: {}", i + 1, h.title, h.text))
            .collect::<Vec<_>>()
            .join("\n"))
    }
}

rlhost_sdk::export!(tools: Search);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_percent_encoded() {
        assert_eq!(encode("capital of Veloria?"), "capital%20of%20Veloria%3F");
        assert_eq!(encode("a&b=c/é"), "a%26b%3Dc%2F%C3%A9");
    }

    #[test]
    fn config_mistakes_are_refused() {
        let sample = || Sample {
            messages: Vec::new(),
            metadata: "{}".into(),
        };
        let open = |c: &str| Search::open(c, sample()).err().unwrap_or_default();
        assert!(open("{}").contains("url"));
        assert!(open(r#"{"url": "ftp://x"}"#).contains("not http"));
        assert!(open(r#"{"url": "http://x", "k": 0}"#).contains("1..=20"));
        assert!(open(r#"{"url": "http://x", "extra": 1}"#).contains("unknown field"));
    }
}
