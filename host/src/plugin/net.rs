//! Outbound HTTP grants: a plugin's `allow_http` entries, in the shape of Spin's
//! `allowed_outbound_hosts` (`scheme://host[:port]`, no paths), and the check every
//! request passes before the host connects anywhere.
//!
//! A destination passes in two stages. Its URL first: some entry must match its scheme,
//! host and port. Then every address its name resolved to: a public address passes; a
//! loopback, private, link-local or otherwise special one only when the matching entry
//! names it (the address itself, or `localhost` for loopback). So a name granted as a
//! public service that resolves to 127.0.0.1 (DNS rebinding, a hostile resolver) is
//! refused, and `*` never reaches the machine or its network. The host connects to the
//! addresses it checked, not to the name again.
//!
//! Entry syntax:
//! - scheme: `http`, `https` or `*` (either);
//! - host: a name (`api.example.com`, matched case-insensitively), `*.suffix` (any name
//!   under the suffix, not the suffix itself), an IP address (`127.0.0.1`, `[::1]`), or
//!   `*` (any name; public addresses only);
//! - port: a number, `lo..hi` (inclusive), or `*`; omitted, the scheme's own (80 for
//!   `http`, 443 for `https`; `*://` needs one).

use std::fmt;
use std::net::IpAddr;

/// One `allow_http` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpGrant {
    scheme: Scheme,
    host: Host,
    ports: Ports,
    /// The entry as written, for messages.
    text: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    Http,
    Https,
    Any,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Host {
    /// A name, lowercase, without a trailing dot.
    Name(String),
    /// `*.suffix`: the suffix with its leading dot (`.example.org`).
    Under(String),
    Ip(IpAddr),
    Any,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ports {
    Range(u16, u16),
    Any,
}

impl HttpGrant {
    /// Reads one entry; the error says what is wrong with it and what to write.
    pub fn parse(entry: &str) -> Result<HttpGrant, String> {
        let bad = |why: &str| format!("allow_http entry \"{entry}\": {why}");
        let (scheme, rest) = entry.split_once("://").ok_or_else(|| {
            bad("write it as scheme://host[:port], e.g. \"https://api.example.com\"")
        })?;
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "http" => Scheme::Http,
            "https" => Scheme::Https,
            "*" => Scheme::Any,
            other => return Err(bad(&format!("scheme `{other}`: only http, https or *"))),
        };
        if let Some(i) = rest.find(['/', '?', '#']) {
            return Err(bad(&format!(
                "grants name hosts, not paths: drop \"{}\"",
                &rest[i..]
            )));
        }
        if rest.contains('@') {
            return Err(bad("no user or password in a grant"));
        }
        // `[v6]:port`, `host:port` or `host`.
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (addr, after) = v6
                .split_once(']')
                .ok_or_else(|| bad("an IPv6 address needs its closing `]`"))?;
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| bad("write the port after `]:`"))?,
                ),
            };
            let ip = addr
                .parse::<std::net::Ipv6Addr>()
                .map_err(|_| bad(&format!("`{addr}` is not an IPv6 address")))?;
            (Host::Ip(canonical(IpAddr::V6(ip))), port)
        } else {
            let (host, port) = match rest.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (rest, None),
            };
            (read_host(host).map_err(|why| bad(&why))?, port)
        };
        let ports = match port {
            None => match scheme {
                Scheme::Http => Ports::Range(80, 80),
                Scheme::Https => Ports::Range(443, 443),
                Scheme::Any => return Err(bad("`*://` needs a port (or `:*`)")),
            },
            Some("*") => Ports::Any,
            Some(p) => {
                let num = |s: &str| {
                    s.parse::<u16>()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| bad(&format!("port `{s}`: a number from 1 to 65535")))
                };
                match p.split_once("..") {
                    Some((lo, hi)) => {
                        let (lo, hi) = (num(lo)?, num(hi)?);
                        if lo > hi {
                            return Err(bad(&format!("port range {lo}..{hi} is empty")));
                        }
                        Ports::Range(lo, hi)
                    }
                    None => {
                        let n = num(p)?;
                        Ports::Range(n, n)
                    }
                }
            }
        };
        Ok(HttpGrant {
            scheme,
            host,
            ports,
            text: entry.to_string(),
        })
    }

    /// Whether this entry covers `scheme://host:port` (the URL alone, before any address
    /// is known). `host` may be a name or an IP address (IPv6 with or without brackets).
    fn covers(&self, scheme: &str, host: &str, port: u16) -> bool {
        let scheme_ok = match self.scheme {
            Scheme::Any => scheme == "http" || scheme == "https",
            Scheme::Http => scheme == "http",
            Scheme::Https => scheme == "https",
        };
        let port_ok = match self.ports {
            Ports::Any => true,
            Ports::Range(lo, hi) => (lo..=hi).contains(&port),
        };
        let host_ok = match (&self.host, literal_ip(host)) {
            (Host::Ip(ip), Some(given)) => *ip == given,
            (Host::Ip(_), None) => false,
            (Host::Any, _) => true,
            (Host::Name(_) | Host::Under(_), Some(_)) => false,
            (Host::Name(n), None) => *n == normal_name(host),
            (Host::Under(suffix), None) => {
                let h = normal_name(host);
                h.len() > suffix.len() && h.ends_with(suffix.as_str())
            }
        };
        scheme_ok && port_ok && host_ok
    }

    /// Whether this entry names `ip`, so that it may be reached although it is not a
    /// public address: the entry is that address, or `localhost` and `ip` is loopback.
    fn names(&self, ip: IpAddr) -> bool {
        match &self.host {
            Host::Ip(granted) => *granted == canonical(ip),
            Host::Name(n) => n == "localhost" && canonical(ip).is_loopback(),
            Host::Under(_) | Host::Any => false,
        }
    }

    /// The entry as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// A plugin's `allow_http` entries. None: no outbound HTTP at all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpGrants(Vec<HttpGrant>);

impl HttpGrants {
    /// Reads every entry; the first bad one is the error.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<HttpGrants, String> {
        entries
            .iter()
            .map(|e| HttpGrant::parse(e.as_ref()))
            .collect::<Result<Vec<_>, _>>()
            .map(HttpGrants)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The URL check: the first entry that covers `scheme://host:port`.
    pub fn check_url(&self, scheme: &str, host: &str, port: u16) -> Result<&HttpGrant, Denial> {
        let scheme = scheme.to_ascii_lowercase();
        self.0
            .iter()
            .find(|g| g.covers(&scheme, host, port))
            .ok_or_else(|| Denial::NoGrant {
                destination: destination(&scheme, host, port),
                would_allow: would_allow(&scheme, host, port),
            })
    }

    /// The address check, after the URL's: every address `host` resolved to must be
    /// public or named by an entry covering the URL. Returns the addresses to connect to.
    pub fn check_addresses(
        &self,
        scheme: &str,
        host: &str,
        port: u16,
        addrs: &[IpAddr],
    ) -> Result<Vec<IpAddr>, Denial> {
        let scheme = scheme.to_ascii_lowercase();
        let covering: Vec<&HttpGrant> = self
            .0
            .iter()
            .filter(|g| g.covers(&scheme, host, port))
            .collect();
        if covering.is_empty() {
            return Err(self.check_url(&scheme, host, port).unwrap_err());
        }
        if addrs.is_empty() {
            return Err(Denial::Unresolved {
                destination: destination(&scheme, host, port),
            });
        }
        for &ip in addrs {
            if let Some(kind) = special(ip)
                && !covering.iter().any(|g| g.names(ip))
            {
                return Err(Denial::Address {
                    destination: destination(&scheme, host, port),
                    address: canonical(ip),
                    kind,
                    by_name: literal_ip(host).is_none() && normal_name(host) != "localhost",
                    would_allow: if literal_ip(host).is_none() && normal_name(host) == "localhost" {
                        would_allow(&scheme, "localhost", port)
                    } else {
                        would_allow(&scheme, &ip_host(canonical(ip)), port)
                    },
                });
            }
        }
        Ok(addrs.iter().map(|&ip| canonical(ip)).collect())
    }
}

/// Why a request was refused; its text names the destination and, where one exists, the
/// entry that would allow it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// No entry covers the URL.
    NoGrant {
        destination: String,
        would_allow: String,
    },
    /// The name resolved to an address no covering entry names.
    Address {
        destination: String,
        address: IpAddr,
        kind: &'static str,
        would_allow: String,
        /// The URL named a host other than the address (or `localhost`): no entry lets
        /// that name reach the address; only a request to the address itself can.
        by_name: bool,
    },
    /// The name resolved to nothing.
    Unresolved { destination: String },
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Denial::NoGrant {
                destination,
                would_allow,
            } => write!(
                f,
                "HTTP to {destination} denied: no allow_http entry covers it \
                 (allow_http = [\"{would_allow}\"] would)"
            ),
            Denial::Address {
                destination,
                address,
                kind,
                would_allow,
                by_name: false,
            } => write!(
                f,
                "HTTP to {destination} denied: {address} is {} address, which only an \
                 entry naming it reaches (allow_http = [\"{would_allow}\"] would)",
                with_article(kind)
            ),
            Denial::Address {
                destination,
                address,
                kind,
                would_allow,
                by_name: true,
            } => write!(
                f,
                "HTTP to {destination} denied: the name resolves to {address}, {} \
                 address, which no entry lets a name reach (to use it, request the address \
                 itself with allow_http = [\"{would_allow}\"])",
                with_article(kind)
            ),
            Denial::Unresolved { destination } => {
                write!(
                    f,
                    "HTTP to {destination} failed: the name resolves to no address"
                )
            }
        }
    }
}

impl std::error::Error for Denial {}

/// `a loopback`, `an unspecified`: the kind of address with its article.
fn with_article(kind: &str) -> String {
    let vowel = kind.starts_with(['a', 'e', 'i', 'o', 'u', 'I']);
    format!("{} {kind}", if vowel { "an" } else { "a" })
}

/// What kind of special address `ip` is, or `None` for a public one. IPv4-mapped IPv6
/// addresses are judged as the IPv4 address they carry.
pub fn special(ip: IpAddr) -> Option<&'static str> {
    match canonical(ip) {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            if v4.is_loopback() {
                Some("loopback")
            } else if v4.is_unspecified() || a == 0 {
                Some("unspecified")
            } else if v4.is_private() {
                Some("private")
            } else if v4.is_link_local() {
                Some("link-local")
            } else if a == 100 && (64..128).contains(&b) {
                Some("shared (carrier-grade NAT)")
            } else if v4.is_multicast() {
                Some("multicast")
            } else if v4.is_broadcast() {
                Some("broadcast")
            } else if v4.is_documentation() {
                Some("documentation")
            } else if a == 198 && (b == 18 || b == 19) {
                Some("benchmarking")
            } else if a == 192 && b == 0 && c == 0 {
                Some("IETF protocol assignment")
            } else if a >= 240 {
                Some("reserved")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if first & 0xfe00 == 0xfc00 {
                Some("unique local (private)")
            } else if first & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else if first == 0x2001 && v6.segments()[1] == 0x0db8 {
                Some("documentation")
            } else if first == 0x0064 && v6.segments()[1] == 0xff9b {
                // NAT64: the IPv4 address it carries could be anything.
                Some("NAT64")
            } else {
                None
            }
        }
    }
}

/// `ip` with an IPv4-mapped IPv6 address turned into the IPv4 one.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// `host` as an IP address, if it is one (IPv6 with or without brackets).
fn literal_ip(host: &str) -> Option<IpAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse().ok().map(canonical)
}

fn normal_name(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// A grant's host part: `*`, `*.suffix`, an IPv4 address or a DNS name.
fn read_host(host: &str) -> Result<Host, String> {
    if host == "*" {
        return Ok(Host::Any);
    }
    if let Some(suffix) = host.strip_prefix("*.") {
        let suffix = normal_name(suffix);
        return if valid_name(&suffix) && suffix.contains('.') {
            Ok(Host::Under(format!(".{suffix}")))
        } else {
            Err(format!(
                "`*.{suffix}`: a wildcard needs a domain of two labels or more after it"
            ))
        };
    }
    if host.contains('*') {
        return Err(format!(
            "`{host}`: `*` stands alone or as the first label (`*.example.org`)"
        ));
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(Host::Ip(canonical(ip)));
    }
    let name = normal_name(host);
    if valid_name(&name) {
        Ok(Host::Name(name))
    } else {
        Err(format!(
            "`{host}` is not a host name (letters, digits, `-` and `.`; IPv6 in brackets)"
        ))
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

fn ip_host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    }
}

fn destination(scheme: &str, host: &str, port: u16) -> String {
    format!("{scheme}://{host}:{port}")
}

/// The narrowest entry that would cover `scheme://host:port`.
fn would_allow(scheme: &str, host: &str, port: u16) -> String {
    let default = matches!((scheme, port), ("http", 80) | ("https", 443));
    if default {
        format!("{scheme}://{host}")
    } else {
        format!("{scheme}://{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grants(entries: &[&str]) -> HttpGrants {
        HttpGrants::parse(entries).unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn entries_read_as_spin_writes_them() {
        let g = grants(&[
            "https://api.example.com",
            "http://127.0.0.1:8080",
            "https://*.example.org:8443",
            "*://search.test:9000..9010",
            "http://[::1]:*",
        ]);
        assert!(g.check_url("https", "api.example.com", 443).is_ok());
        assert!(g.check_url("HTTPS", "API.Example.com.", 443).is_ok());
        assert!(
            g.check_url("http", "api.example.com", 80).is_err(),
            "https only"
        );
        assert!(
            g.check_url("https", "api.example.com", 8443).is_err(),
            "443 only"
        );
        assert!(g.check_url("http", "127.0.0.1", 8080).is_ok());
        assert!(g.check_url("https", "a.b.example.org", 8443).is_ok());
        assert!(
            g.check_url("https", "example.org", 8443).is_err(),
            "subdomains only"
        );
        assert!(g.check_url("https", "badexample.org", 8443).is_err());
        assert!(g.check_url("http", "search.test", 9005).is_ok());
        assert!(g.check_url("https", "search.test", 9010).is_ok());
        assert!(g.check_url("http", "search.test", 9011).is_err());
        assert!(g.check_url("http", "[::1]", 1234).is_ok());
        assert!(g.check_url("http", "::1", 1234).is_ok());
        assert!(
            HttpGrants::default()
                .check_url("https", "example.com", 443)
                .is_err()
        );
    }

    #[test]
    fn bad_entries_say_what_to_write() {
        for (entry, says) in [
            ("api.example.com", "scheme://host[:port]"),
            ("ftp://example.com", "only http, https or *"),
            ("https://example.com/v1", "drop \"/v1\""),
            ("https://example.com?q=1", "drop \"?q=1\""),
            ("https://user@example.com", "no user"),
            ("https://example.com:0", "from 1 to 65535"),
            ("https://example.com:70000", "from 1 to 65535"),
            ("https://example.com:90..80", "is empty"),
            ("*://example.com", "needs a port"),
            ("https://*.org", "two labels"),
            ("https://api.*.org", "first label"),
            ("https://exa mple.com", "not a host name"),
            ("http://[::1", "closing `]`"),
            ("http://[not-v6]:80", "not an IPv6 address"),
        ] {
            let err = HttpGrant::parse(entry).unwrap_err();
            assert!(err.contains(entry), "{err}");
            assert!(err.contains(says), "{entry}: {err}");
        }
    }

    #[test]
    fn special_addresses_are_named_and_public_ones_are_not() {
        for (addr, kind) in [
            ("127.0.0.1", "loopback"),
            ("127.8.9.10", "loopback"),
            ("0.0.0.0", "unspecified"),
            ("10.1.2.3", "private"),
            ("172.16.0.1", "private"),
            ("192.168.1.1", "private"),
            ("169.254.169.254", "link-local"),
            ("100.64.0.1", "shared (carrier-grade NAT)"),
            ("224.0.0.1", "multicast"),
            ("255.255.255.255", "broadcast"),
            ("192.0.2.1", "documentation"),
            ("198.18.0.1", "benchmarking"),
            ("240.0.0.1", "reserved"),
            ("::1", "loopback"),
            ("::", "unspecified"),
            ("fd00::1", "unique local (private)"),
            ("fe80::1", "link-local"),
            ("ff02::1", "multicast"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.0.0.1", "private"),
            ("64:ff9b::7f00:1", "NAT64"),
        ] {
            assert_eq!(special(ip(addr)), Some(kind), "{addr}");
        }
        for addr in [
            "93.184.215.14",
            "1.1.1.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert_eq!(special(ip(addr)), None, "{addr}");
        }
    }

    /// Issue 51: "a unspecified address".
    #[test]
    fn a_denial_names_the_kind_with_its_article() {
        let g = grants(&["http://*:8080"]);
        let err = g
            .check_addresses("http", "0.0.0.0", 8080, &[ip("0.0.0.0")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("0.0.0.0 is an unspecified address"), "{err}");
        let err = g
            .check_addresses("http", "127.0.0.1", 8080, &[ip("127.0.0.1")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("127.0.0.1 is a loopback address"), "{err}");
    }

    #[test]
    fn loopback_and_private_addresses_only_when_an_entry_names_them() {
        let g = grants(&[
            "http://*:8080",
            "https://api.example.com",
            "http://localhost:9000",
        ]);
        // A name granted as a public service that resolves to loopback or a private
        // network (DNS rebinding, a hostile resolver) is refused.
        let err = g
            .check_addresses("http", "localhost", 8080, &[ip("127.0.0.1")])
            .unwrap_err();
        assert!(matches!(
            err,
            Denial::Address {
                kind: "loopback",
                ..
            }
        ));
        let text = err.to_string();
        assert!(text.contains("http://localhost:8080"), "{text}");
        assert!(text.contains("127.0.0.1 is a loopback address"), "{text}");
        assert!(
            text.contains("allow_http = [\"http://localhost:8080\"] would"),
            "{text}"
        );
        // Another name resolving to a private address: only the address itself can go.
        let err = g
            .check_addresses("http", "intranet.test", 8080, &[ip("10.1.2.3")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the name resolves to 10.1.2.3, a private address"),
            "{err}"
        );
        assert!(
            err.contains("request the address itself with allow_http = [\"http://10.1.2.3:8080\"]"),
            "{err}"
        );
        let err = g
            .check_addresses(
                "https",
                "api.example.com",
                443,
                &[ip("93.184.215.14"), ip("10.0.0.7")],
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                Denial::Address {
                    kind: "private",
                    ..
                }
            ),
            "every address is checked"
        );
        assert!(
            g.check_addresses(
                "https",
                "api.example.com",
                443,
                &[ip("::ffff:169.254.169.254")]
            )
            .is_err()
        );
        // Public addresses pass; `localhost` names loopback; an address entry names itself.
        assert_eq!(
            g.check_addresses("https", "api.example.com", 443, &[ip("93.184.215.14")]),
            Ok(vec![ip("93.184.215.14")])
        );
        assert!(
            g.check_addresses("http", "localhost", 9000, &[ip("127.0.0.1"), ip("::1")])
                .is_ok()
        );
        let own = grants(&["http://127.0.0.1:8080", "http://[fd00::5]:80"]);
        assert!(
            own.check_addresses("http", "127.0.0.1", 8080, &[ip("127.0.0.1")])
                .is_ok()
        );
        assert!(
            own.check_addresses("http", "[fd00::5]", 80, &[ip("fd00::5")])
                .is_ok()
        );
        assert!(
            own.check_addresses("http", "127.0.0.1", 8081, &[ip("127.0.0.1")])
                .is_err()
        );
        // Nothing resolved is its own error; an uncovered URL fails before addresses.
        assert!(matches!(
            g.check_addresses("https", "api.example.com", 443, &[]),
            Err(Denial::Unresolved { .. })
        ));
        let err = g
            .check_addresses("https", "evil.example", 443, &[ip("1.1.1.1")])
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "HTTP to https://evil.example:443 denied: no allow_http entry covers it \
             (allow_http = [\"https://evil.example\"] would)"
        );
    }
}
