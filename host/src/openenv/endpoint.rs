//! `rollout.openenv.url`, read and checked: the OpenEnv server's host, port and base path.
//! Its own file so that the config's checks and the client read a URL one way, neither
//! importing the other.

/// `rollout.openenv.url`, read: `http://host[:port][/base]` (`ws://` is taken as the
/// same server).
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    /// The base path, without a trailing `/` (usually empty).
    pub base: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, String> {
        let rest = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("ws://"))
            .ok_or_else(|| {
                if url.starts_with("https://") || url.starts_with("wss://") {
                    format!("{url:?}: TLS (https, wss) is not supported yet; reach the server over http:// on a trusted network or a tunnel")
                } else {
                    format!("{url:?} is not an http:// URL such as \"http://127.0.0.1:8000\"")
                }
            })?;
        let (authority, base) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.contains('@') || base.contains(['?', '#']) {
            return Err(format!(
                "{url:?}: no user, query or fragment in the server's URL"
            ));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (ip, after) = v6
                .split_once(']')
                .ok_or_else(|| format!("{url:?}: an IPv6 address needs its closing `]`"))?;
            if !after.is_empty() && !after.starts_with(':') {
                return Err(format!("{url:?}: after `]` comes `:port` or nothing"));
            }
            (format!("[{ip}]"), after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (authority.to_string(), None),
            }
        };
        if host.is_empty() || host == "[]" {
            return Err(format!("{url:?} names no host"));
        }
        let port = match port {
            None => 80,
            Some(p) => match p.parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => {
                    return Err(format!(
                        "{url:?}: port {p:?} is not a number from 1 to 65535"
                    ));
                }
            },
        };
        Ok(Endpoint {
            host,
            port,
            base: base.to_string(),
        })
    }

    /// The `allow` entry that grants exactly this server.
    pub fn grant(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }

    pub fn authority(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// The host without IPv6 brackets, as a resolver takes it.
    pub fn bare_host(&self) -> &str {
        self.host.trim_start_matches('[').trim_end_matches(']')
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_read_or_refused_with_the_reason() {
        let e = Endpoint::parse("http://127.0.0.1:8000/").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.base.as_str()),
            ("127.0.0.1", 8000, "")
        );
        assert_eq!(e.grant(), "http://127.0.0.1:8000");
        let e = Endpoint::parse("ws://[::1]:9/env").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.base.as_str()),
            ("[::1]", 9, "/env")
        );
        assert_eq!(Endpoint::parse("http://localhost").unwrap().port, 80);
        for (url, says) in [
            ("https://x:1", "TLS"),
            ("127.0.0.1:8000", "not an http:// URL"),
            ("http://x:70000", "1 to 65535"),
            ("http://x:0", "1 to 65535"),
            ("http://:80", "no host"),
            ("http://u@x:80", "no user"),
            ("http://[::1]abc", "after `]`"),
        ] {
            let err = Endpoint::parse(url).unwrap_err();
            assert!(err.contains(says), "{url}: {err}");
        }
    }
}
