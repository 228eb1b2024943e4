//! Who is asking: a bearer token (its SHA-256 against `admin.users`), or
//! the headers of a fronting proxy trusted by its address
//! (`admin.proxy`); and what each role may do. Every API call is
//! authenticated on its own: no session state, no cookie (so no request
//! forged by another site carries credentials).

use std::net::IpAddr;

use axum::http::{HeaderMap, header::AUTHORIZATION};
use serde::Serialize;
use sha2::{Digest as _, Sha256};

pub use crate::config::Role;
use crate::config::{ConsoleUser, ProxyConfig};

/// A signed-in user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct User {
    /// The name.
    pub name: String,
    /// The e-mail address (a commit's author).
    pub email: String,
    /// The role.
    pub role: Role,
}

/// Why a request is not signed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No credentials.
    #[error("sign in: no token")]
    Missing,
    /// A token nobody has, or proxy headers without a role.
    #[error("sign in: unknown token or no role")]
    Unknown,
    /// An identity header (the proxy's user, email or groups header)
    /// sent more than once: which one the proxy meant cannot be told (a
    /// proxy that appends its header keeps the client's).
    #[error("sign in: an identity header sent more than once")]
    Duplicated,
}

/// The sign-in of `admin.users` and `admin.proxy`.
#[derive(Debug, Clone)]
pub struct Auth {
    users: Vec<([u8; 32], User)>,
    proxy: ProxyConfig,
}

/// The most bytes a header's value is read for a name or groups.
const MAX_HEADER_BYTES: usize = 1024;

impl Auth {
    /// From validated settings.
    pub fn new(users: &[ConsoleUser], proxy: &ProxyConfig) -> Self {
        let users = users
            .iter()
            .map(|u| {
                let mut hash = [0u8; 32];
                for (i, byte) in hash.iter_mut().enumerate() {
                    *byte = u8::from_str_radix(&u.token_sha256[2 * i..2 * i + 2], 16).unwrap_or_default();
                }
                (hash, User { name: u.name.clone(), email: u.email.clone(), role: u.role })
            })
            .collect();
        Self { users, proxy: proxy.clone() }
    }

    /// The user `headers` (from `peer`) sign in as: the proxy's headers
    /// when the peer is a trusted proxy, else a bearer token.
    pub fn user(&self, headers: &HeaderMap, peer: IpAddr) -> Result<User, Refusal> {
        if let Some(header) = &self.proxy.user_header
            && self.proxy.trusted_peers.contains(&peer)
        {
            let identity =
                [Some(header), self.proxy.email_header.as_ref(), self.proxy.groups_header.as_ref()];
            if identity
                .into_iter()
                .flatten()
                .any(|name| headers.get_all(name.as_str()).iter().nth(1).is_some())
            {
                return Err(Refusal::Duplicated);
            }
            if let Some(name) = value(headers, header) {
                return self.proxied(headers, name);
            }
        }
        let token = value(headers, AUTHORIZATION.as_str())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or(Refusal::Missing)?;
        let hash: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
        // Every entry compared, so the time taken does not say which matched.
        let mut found = None;
        for (known, user) in &self.users {
            if known.iter().zip(&hash).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0 {
                found = Some(user);
            }
        }
        found.cloned().ok_or(Refusal::Unknown)
    }

    fn proxied(&self, headers: &HeaderMap, name: &str) -> Result<User, Refusal> {
        let groups = self.proxy.groups_header.as_deref().and_then(|h| value(headers, h)).unwrap_or_default();
        let member = |of: &[String]| groups.split(',').map(str::trim).any(|g| of.iter().any(|o| o == g));
        let role = [
            (Role::Publisher, &self.proxy.publisher_groups),
            (Role::Editor, &self.proxy.editor_groups),
            (Role::Viewer, &self.proxy.viewer_groups),
        ]
        .into_iter()
        .find(|(_, of)| member(of))
        .map(|(role, _)| role)
        .ok_or(Refusal::Unknown)?;
        let email = self
            .proxy
            .email_header
            .as_deref()
            .and_then(|h| value(headers, h))
            .filter(|e| e.contains('@'))
            .map_or_else(|| format!("{name}@proxy.invalid"), str::to_owned);
        Ok(User { name: name.to_owned(), email, role })
    }
}

/// A header's value: visible ASCII, bounded, not empty.
fn value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    let value = headers.get(name)?.to_str().ok()?.trim();
    (!value.is_empty() && value.len() <= MAX_HEADER_BYTES).then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(token: &str) -> String {
        Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }

    fn users() -> Vec<ConsoleUser> {
        vec![
            ConsoleUser {
                name: "Eve Editor".into(),
                email: "eve@example.com".into(),
                role: Role::Editor,
                token_sha256: hash("eve-token"),
            },
            ConsoleUser {
                name: "Pat Publisher".into(),
                email: "pat@example.com".into(),
                role: Role::Publisher,
                token_sha256: hash("pat-token").to_ascii_uppercase(),
            },
        ]
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (axum::http::HeaderName::from_static(k), v.parse().unwrap())).collect()
    }

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[test]
    fn a_token_signs_in_as_its_user_and_nothing_else_does() {
        let auth = Auth::new(&users(), &ProxyConfig::default());
        let eve = auth.user(&headers(&[("authorization", "Bearer eve-token")]), LOCAL).unwrap();
        assert_eq!((eve.name.as_str(), eve.role), ("Eve Editor", Role::Editor));
        let pat = auth.user(&headers(&[("authorization", "Bearer pat-token")]), LOCAL).unwrap();
        assert_eq!(pat.role, Role::Publisher, "upper-case hex configured");
        assert_eq!(auth.user(&headers(&[("authorization", "Bearer nope")]), LOCAL), Err(Refusal::Unknown));
        assert_eq!(auth.user(&headers(&[("authorization", "eve-token")]), LOCAL), Err(Refusal::Missing));
        assert_eq!(auth.user(&headers(&[]), LOCAL), Err(Refusal::Missing));
    }

    #[test]
    fn proxy_headers_count_only_from_a_trusted_peer() {
        let proxy = ProxyConfig {
            user_header: Some("x-forwarded-user".into()),
            email_header: Some("x-forwarded-email".into()),
            groups_header: Some("x-forwarded-groups".into()),
            viewer_groups: vec!["staff".into()],
            editor_groups: vec!["sre".into()],
            publisher_groups: vec!["sre-leads".into()],
            trusted_peers: vec![LOCAL],
        };
        let auth = Auth::new(&users(), &proxy);
        let claim = headers(&[
            ("x-forwarded-user", "grace"),
            ("x-forwarded-email", "grace@example.com"),
            ("x-forwarded-groups", "staff, sre-leads"),
        ]);
        let grace = auth.user(&claim, LOCAL).unwrap();
        assert_eq!((grace.email.as_str(), grace.role), ("grace@example.com", Role::Publisher));
        let elsewhere: IpAddr = "192.0.2.7".parse().unwrap();
        assert_eq!(
            auth.user(&claim, elsewhere),
            Err(Refusal::Missing),
            "an untrusted peer's claim is ignored"
        );
        let no_group = headers(&[("x-forwarded-user", "mallory"), ("x-forwarded-groups", "guests")]);
        assert_eq!(auth.user(&no_group, LOCAL), Err(Refusal::Unknown));
        // A proxy that appends its header after the client's: neither is taken.
        for twice in ["x-forwarded-user", "x-forwarded-email", "x-forwarded-groups"] {
            let mut claim = claim.clone();
            let first = claim.get(twice).unwrap().clone();
            claim.insert(twice, "mallory".parse().unwrap());
            claim.append(twice, first);
            assert_eq!(auth.user(&claim, LOCAL), Err(Refusal::Duplicated), "{twice} twice");
        }
    }

    #[test]
    fn roles_are_ordered() {
        assert!(Role::Viewer < Role::Editor && Role::Editor < Role::Publisher);
    }
}
