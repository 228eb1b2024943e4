//! `admin.*`: the admin console's listener, the rules' Git repository it
//! writes to, the captures it gates against, its audit log and who may
//! sign in.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

/// What a console user may do; each role may do what the ones before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Sees instances, rules, history and the audit log.
    Viewer,
    /// Also edits, validates, diffs, gates and proposes changes.
    Editor,
    /// Also publishes and rolls back.
    Publisher,
}

impl Role {
    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Editor => "editor",
            Role::Publisher => "publisher",
        }
    }
}

/// `admin.*`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsoleConfig {
    /// Address of the console's pages and API (`ratelimitd admin`).
    pub listen: String,
    /// The rules' Git repository (a bare repository is best: the console
    /// writes commits without a work tree). Required by `ratelimitd admin`.
    pub repo: Option<PathBuf>,
    /// The branch whose head is the rules' truth.
    pub branch: String,
    /// Native rules in the repository: a file or a directory; unset: none.
    pub rules_path: Option<PathBuf>,
    /// The Envoy configuration in the repository: a file or a directory.
    pub envoy_path: Option<PathBuf>,
    /// limitador's limits file in the repository (published for instances
    /// with `rules.limitador_path`).
    pub limitador_path: Option<PathBuf>,
    /// A directory of captures (`*.jsonl`) the gate may replay; unset: the
    /// console cannot gate (and cannot publish with `rules.kafka.require_gate`).
    pub captures_dir: Option<PathBuf>,
    /// The audit log, JSON lines, appended and synced per action.
    ///
    /// Default: `admin-audit.jsonl` in the state directory
    pub audit_log: PathBuf,
    /// Users signing in with a token.
    pub users: Vec<ConsoleUser>,
    /// Sign-in by a fronting proxy's headers (OIDC-compatible proxies).
    pub proxy: ProxyConfig,
}

/// One `admin.users` entry.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleUser {
    /// The name shown and written as a commit's author.
    pub name: String,
    /// The e-mail address of its commits.
    pub email: String,
    /// What the user may do.
    pub role: Role,
    /// SHA-256 of the user's token, hex (`printf %s TOKEN | sha256sum`);
    /// the token itself is never configured.
    pub token_sha256: String,
}

/// `admin.proxy.*`: a proxy in front of the console that signs users in
/// and passes who they are in headers. Trusted only from `trusted_peers`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyConfig {
    /// The header naming the user (e.g. `X-Forwarded-User`); unset: no
    /// proxy sign-in.
    pub user_header: Option<String>,
    /// The header with the user's e-mail address (e.g. `X-Forwarded-Email`).
    pub email_header: Option<String>,
    /// The header listing the user's groups, comma-separated.
    pub groups_header: Option<String>,
    /// Groups whose members are viewers.
    pub viewer_groups: Vec<String>,
    /// Groups whose members are editors.
    pub editor_groups: Vec<String>,
    /// Groups whose members are publishers.
    pub publisher_groups: Vec<String>,
    /// The proxy's addresses: headers from any other peer are ignored
    /// (anyone reaching the port directly could claim to be anyone).
    pub trusted_peers: Vec<IpAddr>,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8082".to_owned(),
            repo: None,
            branch: "main".to_owned(),
            rules_path: None,
            envoy_path: None,
            limitador_path: None,
            captures_dir: None,
            audit_log: PathBuf::new(),
            users: Vec::new(),
            proxy: ProxyConfig::default(),
        }
    }
}

impl ConsoleConfig {
    /// The validated listen address.
    pub fn addr(&self) -> SocketAddr {
        self.listen.parse().expect("admin.listen is validated")
    }

    /// Checks `admin.*`; every error names its key. A setting that would
    /// let anyone in fails closed.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen.parse::<SocketAddr>().map_err(|e| {
            invalid("admin.listen", format!("{:?} is not an ip:port address: {e}", self.listen))
        })?;
        if self.branch.is_empty() || self.branch.starts_with('-') || self.branch.contains("..") {
            return Err(invalid("admin.branch", format!("{:?} is not a branch name", self.branch)));
        }
        let paths = [
            ("admin.rules_path", &self.rules_path),
            ("admin.envoy_path", &self.envoy_path),
            ("admin.limitador_path", &self.limitador_path),
        ];
        for (key, path) in paths {
            if path.as_deref().is_some_and(|p| !crate::rollout::git::inside(p)) {
                return Err(invalid(key, "give a relative path inside the repository, without `..`"));
            }
        }
        let mut hashes = std::collections::HashSet::new();
        for (i, user) in self.users.iter().enumerate() {
            let hex =
                user.token_sha256.len() == 64 && user.token_sha256.bytes().all(|b| b.is_ascii_hexdigit());
            if !hex {
                return Err(invalid(
                    "admin.users",
                    format!("users[{i}] ({}): token_sha256 is not 64 hex digits", user.name),
                ));
            }
            if user.name.trim().is_empty() || !user.email.contains('@') || has_control(&user.name) {
                return Err(invalid("admin.users", format!("users[{i}]: give a name and an e-mail address")));
            }
            if !hashes.insert(user.token_sha256.to_ascii_lowercase()) {
                return Err(invalid(
                    "admin.users",
                    format!("users[{i}] ({}): another user has this token", user.name),
                ));
            }
        }
        self.proxy.validate()
    }

    /// Checks what `ratelimitd admin` needs beyond a valid section.
    pub fn runnable(&self) -> Result<(), ConfigError> {
        if self.repo.is_none() {
            return Err(invalid("admin.repo", "the console needs the rules' Git repository"));
        }
        if self.rules_path.is_none() && self.envoy_path.is_none() && self.limitador_path.is_none() {
            return Err(invalid(
                "admin.rules_path",
                "set at least one of admin.rules_path, admin.envoy_path, admin.limitador_path",
            ));
        }
        if self.users.is_empty() && self.proxy.user_header.is_none() {
            return Err(invalid("admin.users", "nobody can sign in: configure admin.users or admin.proxy"));
        }
        Ok(())
    }
}

fn has_control(text: &str) -> bool {
    text.chars().any(char::is_control)
}

impl ProxyConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let Some(header) = &self.user_header else {
            return Ok(());
        };
        for (key, name) in [
            ("admin.proxy.user_header", Some(header)),
            ("admin.proxy.email_header", self.email_header.as_ref()),
            ("admin.proxy.groups_header", self.groups_header.as_ref()),
        ] {
            if name.is_some_and(|n| axum::http::HeaderName::from_bytes(n.as_bytes()).is_err()) {
                return Err(invalid(key, "not an HTTP header name"));
            }
        }
        if self.trusted_peers.is_empty() {
            return Err(invalid(
                "admin.proxy.trusted_peers",
                "proxy sign-in needs the proxy's addresses: headers from anyone else would be believed",
            ));
        }
        if self.groups_header.is_none() {
            return Err(invalid(
                "admin.proxy.groups_header",
                "proxy sign-in needs the groups that give roles",
            ));
        }
        Ok(())
    }
}
