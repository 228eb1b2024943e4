//! The immutable, compiled rule set the hot path reads.
//!
//! Matching: the most specific path wins first (an exact path, then prefix
//! patterns from the longest down); at the same path, a rule for the request's
//! client type beats a rule for any client. An exact path is one hash lookup;
//! prefixes cost one hash lookup per distinct prefix length, not per rule.
//! The maps use hashbrown's foldhash rather than std's SipHash: lookup plus
//! the shedding check over 10,000 rules went from 104 ns to 46 ns
//! (benches/hot_path.rs). Flooding is no concern here: the keys come from the
//! configuration, so requests cannot plant colliding entries. (The memory
//! store, whose keys are user ids, keeps SipHash for exactly that reason.)

use std::{
    borrow::Cow,
    fmt::Write as _,
    path::{Path, PathBuf},
    time::SystemTime,
};

use hashbrown::HashMap;

use super::model::Rule;

/// `rules.path_matching.*`: how request paths and rule patterns are put
/// in one form before they are compared, beyond the fixed canonical form
/// ([`canonical_path`]: dot segments removed, unreserved escapes decoded,
/// `;` parameters cut, `//` collapsed, query cut). Both off by default, as
/// most servers behave; turn one on where the backends behind do the same,
/// so that a variant they serve as one resource is counted as one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct PathForm {
    /// `%2F` is a `/` (a segment boundary); off, it stays an encoded byte
    /// of its segment, as most servers and proxies treat it.
    pub decode_slashes: bool,
    /// Native paths compare without ASCII case (`/API` is `/api`), rules and requests alike; every
    /// instance and `rules publish` must agree ([paths](paths.md)).
    pub ignore_case: bool,
}

/// A `resource_path` as a matching key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum PathKey {
    Exact(String),
    /// The pattern without its trailing `*`.
    Prefix(String),
}

impl PathKey {
    pub(crate) fn of(resource_path: &str, form: PathForm) -> Self {
        match resource_path.strip_suffix('*') {
            Some(prefix) => PathKey::Prefix(canonical_path(prefix, form).into_owned()),
            None => PathKey::Exact(exact_form(&canonical_path(resource_path, form)).to_owned()),
        }
    }
}

/// A path as rules match it, the same form for a request and a rule's
/// pattern, so that no variant a server would serve as the same resource
/// escapes the resource's rule:
/// - cut at the first `?` or `#` (a query string or fragment is not part
///   of the resource);
/// - percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) decoded
///   (`/%74` is `/t`), and `%2F` too with `decode_slashes`; every other
///   escape kept, its hex digits in upper case (`%c3` is `%C3`); never
///   decoded twice (`%2574` is `%2574`);
/// - a segment's `;` parameters cut (`/t;jsessionid=1` is `/t`,
///   `/..;x/t` is `/../t`);
/// - dot segments removed as RFC 3986 (5.2.4) says (`/x/../t`, `/./t`
///   are `/t`; `/t/.` is `/t/`; `/a//..` is `/a/`), never above the root;
/// - then every run of `/` collapsed to one, and a leading `/` added;
/// - ASCII letters in lower case with `ignore_case`.
///
/// Borrowed when already canonical, the usual case: one pass over the
/// bytes. An empty path stays empty.
pub fn canonical_path(path: &str, form: PathForm) -> Cow<'_, str> {
    // Where the path ends, and whether anything in it needs rewriting.
    // Every byte looked at is ASCII, so `end` is a character boundary.
    let bytes = path.as_bytes();
    let mut end = bytes.len();
    let mut plain = bytes.first().is_none_or(|&b| b == b'/');
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'?' | b'#' => {
                end = i;
                break;
            }
            b'%' | b';' => plain = false,
            // A repeated `/`, or a segment starting with `.` (perhaps a
            // dot segment: checked on the slow path).
            b'/' | b'.' if i > 0 && bytes[i - 1] == b'/' => plain = false,
            b'A'..=b'Z' if form.ignore_case => plain = false,
            _ => {}
        }
    }
    let path = &path[..end];
    if plain || path.is_empty() {
        return Cow::Borrowed(path);
    }
    Cow::Owned(rewrite(path, form))
}

/// [`canonical_path`]'s slow path, on a path without query or fragment.
fn rewrite(path: &str, form: PathForm) -> String {
    let decoded = decode_unreserved(path, form.decode_slashes);
    let mut parts = decoded.split('/');
    if decoded.starts_with('/') {
        parts.next(); // the root
    }
    // RFC 3986's segments: an empty one (of `//`) is a segment too, so
    // `/a//..` is `/a/` as a standard normaliser says; runs of `/` are
    // collapsed after.
    let mut segments: Vec<&str> = Vec::new();
    // Whether the path ends in `/` after a dot segment.
    let mut open = false;
    for segment in parts {
        let segment = segment.split_once(';').map_or(segment, |(name, _)| name);
        match segment {
            "." => open = true,
            ".." => {
                segments.pop();
                open = true;
            }
            name => {
                segments.push(name);
                open = false;
            }
        }
    }
    let mut out = String::with_capacity(decoded.len() + 1);
    for segment in segments.iter().filter(|s| !s.is_empty()) {
        out.push('/');
        out.push_str(segment);
    }
    if open || out.is_empty() || segments.last().is_some_and(|s| s.is_empty()) {
        out.push('/');
    }
    if form.ignore_case {
        out.make_ascii_lowercase();
    }
    out
}

/// `path` with its escapes of unreserved characters (and of `/` with
/// `slashes`) decoded and every other escape's hex in upper case. Only
/// ASCII is decoded, so the result is valid UTF-8.
fn decode_unreserved(path: &str, slashes: bool) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = match bytes.get(i..i + 3) {
            Some([b'%', hi, lo]) => hex(*hi).zip(hex(*lo)).map(|(hi, lo)| hi << 4 | lo),
            _ => None,
        };
        match escaped {
            Some(byte)
                if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) || (slashes && byte == b'/') =>
            {
                out.push(char::from(byte));
                i += 3;
            }
            Some(_) => {
                out.push('%');
                out.push(char::from(bytes[i + 1].to_ascii_uppercase()));
                out.push(char::from(bytes[i + 2].to_ascii_uppercase()));
                i += 3;
            }
            None => {
                // Copy up to the next `%` (a character boundary: ASCII).
                let next = bytes[i + 1..].iter().position(|&b| b == b'%').map_or(bytes.len(), |p| i + 1 + p);
                out.push_str(&path[i..next]);
                i = next;
            }
        }
    }
    out
}

fn hex(digit: u8) -> Option<u8> {
    char::from(digit).to_digit(16).map(|d| d as u8)
}

/// An exact path without its trailing `/` (but `/` itself): `/a/` and `/a`
/// are one exact path. Prefix patterns keep theirs: `/static/*` does not
/// match `/staticfile`.
fn exact_form(path: &str) -> &str {
    match path.strip_suffix('/') {
        Some(trimmed) if !trimmed.is_empty() => trimmed,
        _ => path,
    }
}

/// The rules registered for one path or prefix.
#[derive(Debug, Default)]
struct Candidates {
    any_client: Option<usize>,
    by_client: HashMap<Box<str>, usize>,
}

impl Candidates {
    fn pick(&self, client_type: Option<&str>) -> Option<usize> {
        client_type.and_then(|c| self.by_client.get(c).copied()).or(self.any_client)
    }
}

/// A validated rule set, versioned by a hash of its content.
#[derive(Debug)]
pub struct Snapshot {
    rules: Vec<Rule>,
    exact: HashMap<Box<str>, Candidates>,
    prefixes: HashMap<Box<str>, Candidates>,
    /// Distinct prefix lengths in bytes, longest first.
    prefix_lens: Vec<usize>,
    /// Indexes of the rules with an adaptive limit.
    adaptive: Vec<usize>,
    version: String,
    source: PathBuf,
    loaded_at: SystemTime,
    form: PathForm,
}

impl Snapshot {
    /// Indexes already validated rules (see [`compile`](super::compile)).
    pub(crate) fn build(source: &Path, rules: Vec<Rule>, form: PathForm) -> Self {
        let mut exact: HashMap<Box<str>, Candidates> = HashMap::new();
        let mut prefixes: HashMap<Box<str>, Candidates> = HashMap::new();
        for (index, rule) in rules.iter().enumerate() {
            let candidates = match PathKey::of(&rule.resource_path, form) {
                PathKey::Exact(path) => exact.entry(path.into_boxed_str()).or_default(),
                PathKey::Prefix(prefix) => prefixes.entry(prefix.into_boxed_str()).or_default(),
            };
            match &rule.client_type {
                Some(client) => {
                    candidates.by_client.insert(client.as_str().into(), index);
                }
                None => candidates.any_client = Some(index),
            }
        }
        let mut prefix_lens: Vec<usize> = prefixes.keys().map(|p| p.len()).collect();
        prefix_lens.sort_unstable_by(|a, b| b.cmp(a));
        prefix_lens.dedup();
        let version = content_hash(&rules);
        let adaptive = (0..rules.len()).filter(|&i| rules[i].adaptive.is_some()).collect();
        Snapshot {
            rules,
            exact,
            prefixes,
            prefix_lens,
            adaptive,
            version,
            source: source.to_path_buf(),
            loaded_at: SystemTime::now(),
            form,
        }
    }

    /// The rule that governs `resource_path` for `client_type`, if any.
    ///
    /// The path is matched in its canonical form ([`canonical_path`], as
    /// the snapshot's [`PathForm`] says; for exact paths without a
    /// trailing `/`), so a variant of a path cannot escape its rule.
    pub fn lookup(&self, resource_path: &str, client_type: Option<&str>) -> Option<&Rule> {
        let canonical = canonical_path(resource_path, self.form);
        let resource_path = canonical.as_ref();
        if let Some(index) = self.exact.get(exact_form(resource_path)).and_then(|c| c.pick(client_type)) {
            return Some(&self.rules[index]);
        }
        for &len in &self.prefix_lens {
            // `get` returns None when `len` falls inside a multi-byte character.
            let Some(prefix) = resource_path.get(..len) else { continue };
            if let Some(index) = self.prefixes.get(prefix).and_then(|c| c.pick(client_type)) {
                return Some(&self.rules[index]);
            }
        }
        None
    }

    /// How its patterns and the paths looked up are put in one form.
    pub fn path_form(&self) -> PathForm {
        self.form
    }

    /// All rules, in load order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The rules with an adaptive limit, in load order.
    pub fn adaptive_rules(&self) -> impl Iterator<Item = &Rule> {
        self.adaptive.iter().map(|&i| &self.rules[i])
    }

    /// Hash of the rule set's content (16 hex digits): equal on every instance
    /// that loaded the same rules, whatever the file layout or comments.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Where the rules were loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// When this snapshot was compiled.
    pub fn loaded_at(&self) -> SystemTime {
        self.loaded_at
    }
}

/// SHA-1 over a canonical rendering of the rules sorted by id, truncated to
/// 64 bits: enough to tell rule sets apart, stable across builds and hosts.
fn content_hash(rules: &[Rule]) -> String {
    let mut sorted: Vec<&Rule> = rules.iter().collect();
    sorted.sort_by(|a, b| a.id.cmp(&b.id));
    let mut canonical = String::new();
    for rule in sorted {
        // Field order is fixed here; `{:?}` of the strings escapes separators.
        let _ = writeln!(
            canonical,
            "{:?}\t{:?}\t{:?}\t{}\t{}\t{}\t{}\t{}\t{}\t{:?}\t{:?}",
            rule.id,
            rule.resource_path,
            rule.client_type,
            rule.priority,
            rule.limit,
            rule.burst_capacity,
            rule.window.window_ms,
            rule.window.capacity,
            rule.window.algorithm.as_str(),
            rule.mode,
            rule.failure_policy,
        );
        // Only present when set, so the versions of sets without it stay as they were.
        if let Some(overload) = &rule.overload {
            let _ =
                writeln!(canonical, "\toverload\t{}\t{}", overload.rate_per_second, overload.per.as_str());
        }
        if let Some(a) = rule.adaptive.as_deref().map(|a| a.params) {
            let _ = writeln!(
                canonical,
                "\tadaptive\t{}\t{}\t{}\t{}\t{}\t{}\t{:?}",
                a.min, a.max, a.increase, a.decrease, a.interval_ms, a.max_failure_ratio, a.latency_ms
            );
        }
        for (index, also) in rule.also.iter().enumerate() {
            let w = &also.window;
            let _ = writeln!(
                canonical,
                "\talso\t{}\t{}\t{}\t{}\t{}",
                also.limit,
                also.burst_capacity,
                w.window_ms,
                w.capacity,
                w.algorithm.as_str()
            );
            counted_in(&mut canonical, rule, index + 1);
        }
        counted_in(&mut canonical, rule, 0);
        if let Some(prices) = &rule.prices {
            let table = serde_json::to_string(prices.raw()).unwrap_or_default();
            let _ = writeln!(canonical, "\tprices\t{table}");
        }
        for key in rule.levels.iter().flat_map(|levels| &levels.keys) {
            let _ = writeln!(canonical, "\tlevel\t{:?}\t{:?}", key.name, key.header);
        }
    }
    let digest = sha1_smol::Sha1::from(canonical.as_bytes()).digest().to_string();
    digest[..16].to_owned()
}

/// Limit `index`'s calendar period, unit and level, in the canonical rendering,
/// each only when set (so the versions of sets without them stay as they
/// were).
fn counted_in(canonical: &mut String, rule: &Rule, index: usize) {
    if let Some(calendar) = rule.calendar_at(index) {
        let _ = writeln!(canonical, "\tperiod\t{}\t{:?}", calendar.period().as_str(), calendar.zone_name());
    }
    if let Some(unit) = rule.unit_at(index) {
        let _ = writeln!(canonical, "\tunit\t{unit:?}");
    }
    if let Some(level) = rule.level_name_at(index) {
        let _ = writeln!(canonical, "\tcharged\t{level:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{compile, native::parse};

    fn snapshot(text: &str) -> Snapshot {
        snapshot_in(text, PathForm::default())
    }

    fn snapshot_in(text: &str, form: PathForm) -> Snapshot {
        compile(Path::new("r.yaml"), parse(Path::new("r.yaml"), text).unwrap(), form).unwrap()
    }

    fn canonical(path: &str) -> Cow<'_, str> {
        canonical_path(path, PathForm::default())
    }

    const RULES: &str = r#"
rules:
  - { rule_id: exact-any, resource_path: /api/v1/playback, limit: 1, window_seconds: 1 }
  - { rule_id: exact-android, resource_path: /api/v1/playback, client_type: ANDROID, limit: 1, window_seconds: 1 }
  - { rule_id: v1-any, resource_path: "/api/v1/*", limit: 1, window_seconds: 1 }
  - { rule_id: api-ios, resource_path: "/api/*", client_type: IOS, limit: 1, window_seconds: 1 }
  - { rule_id: api-any, resource_path: "/api/*", limit: 1, window_seconds: 1 }
  - { rule_id: ios-only, resource_path: /ios-only, client_type: IOS, limit: 1, window_seconds: 1 }
  - { rule_id: catch-all, resource_path: "*", limit: 1, window_seconds: 1 }
"#;

    fn id<'a>(snapshot: &'a Snapshot, path: &str, client: Option<&str>) -> Option<&'a str> {
        snapshot.lookup(path, client).map(|r| &*r.id)
    }

    /// A variant of a path (query string, fragment, repeated or trailing
    /// `/`) reaches the rule of the path itself; prefixes keep their `/`.
    #[test]
    fn path_variants_cannot_escape_an_exact_rule() {
        let s = snapshot(RULES);
        for variant in [
            "/api/v1/playback/",
            "//api/v1/playback",
            "/api//v1///playback",
            "/api/v1/playback?user=x",
            "/api/v1/playback#top",
            "/api/v1/playback/?a=b/c",
        ] {
            assert_eq!(id(&s, variant, Some("ANDROID")), Some("exact-android"), "{variant}");
        }
        assert_eq!(id(&s, "/api//v2/x?y", None), Some("api-any"), "prefixes see the canonical path");
        assert_eq!(canonical("/a/b"), Cow::Borrowed("/a/b"));
        assert_eq!(canonical("/"), "/");
        assert_eq!(exact_form("/"), "/");
        let prefixed = snapshot(
            "rules:\n  - { rule_id: s, resource_path: \"/static/*\", limit: 1, window_seconds: 1 }\n",
        );
        assert_eq!(id(&prefixed, "/staticfile", None), None, "a prefix keeps its trailing /");
        assert_eq!(id(&prefixed, "//static//x.css", None), Some("s"));
        // Two rules for one canonical path are ambiguous.
        let clash = "rules:\n  - { rule_id: a, resource_path: /x, limit: 1, window_seconds: 1 }\n  - { rule_id: b, resource_path: /x/, limit: 1, window_seconds: 1 }\n";
        let errors =
            compile(Path::new("r.yaml"), parse(Path::new("r.yaml"), clash).unwrap(), PathForm::default())
                .unwrap_err();
        assert!(errors[0].message.contains("ambiguous"), "{errors:?}");
    }

    /// What servers serve as `/t` is limited as `/t`: dot segments (also
    /// encoded, also with parameters), escapes of unreserved characters,
    /// `;` parameters, a trailing dot segment; `%2F` and case only where
    /// configured. Rule patterns are read the same way.
    #[test]
    fn variants_a_server_serves_as_the_path_are_the_path() {
        let rules = "rules:\n  - { rule_id: t, resource_path: /t, limit: 2, window_seconds: 60 }\n  \
                     - { rule_id: s, resource_path: \"/static/*\", limit: 1, window_seconds: 1 }\n";
        let s = snapshot(rules);
        for variant in [
            "/./t",
            "/x/../t",
            "/%74",
            "/t;jsessionid=1",
            "/t/.",
            "/a/b/../../t",
            "/../t",
            "/..;x/t",
            "/%2e/t",
            "/%2E%2E/t",
            "/x/%2e%2e/t",
            "t",
            "./t",
            "/t;a=1;b=2?x",
            "/%2574/../t",
        ] {
            assert_eq!(id(&s, variant, None), Some("t"), "{variant}");
        }
        for other in ["/T", "/t%2F", "/tt", "/t.", "/%2574", "/t%2Fx/..", "/..t"] {
            assert_eq!(id(&s, other, None), None, "{other} is another resource by default");
        }
        assert_eq!(id(&s, "/static/../t", None), Some("t"), "a prefix rule is left by `..`");
        assert_eq!(id(&s, "/x/../static/a.css", None), Some("s"));
        assert_eq!(id(&s, "/static/%2e%2e/static/a", None), Some("s"));

        let everything = PathForm { decode_slashes: true, ignore_case: true };
        let s = snapshot_in(&rules.replace("/t,", "/T,"), everything);
        for variant in ["/t", "/T", "/t%2F", "/t%2f", "/x%2F..%2Ft", "/STATIC/../T"] {
            assert_eq!(id(&s, variant, None), Some("t"), "{variant}");
        }
        assert_eq!(id(&s, "/Static/A.css", None), Some("s"));
        let clash = "rules:\n  - { rule_id: a, resource_path: /x, limit: 1, window_seconds: 1 }\n  \
                     - { rule_id: b, resource_path: /X, limit: 1, window_seconds: 1 }\n";
        let errors =
            compile(Path::new("r.yaml"), parse(Path::new("r.yaml"), clash).unwrap(), everything).unwrap_err();
        assert!(errors[0].message.contains("ambiguous"), "{errors:?}");
    }

    #[test]
    fn escapes_keep_their_meaning() {
        assert_eq!(canonical("/a%2fb"), "/a%2Fb", "hex in upper case, the slash kept encoded");
        assert_eq!(canonical("/%C3%a9"), "/%C3%A9");
        assert_eq!(canonical("/%7e%5F%2D"), "/~_-");
        assert_eq!(canonical("/100%"), "/100%", "a broken escape is kept");
        assert_eq!(canonical("/%zz%4"), "/%zz%4");
        assert_eq!(canonical("/é/./x"), "/é/x");
        assert_eq!(canonical(""), "");
        assert_eq!(canonical("/.well-known/x"), "/.well-known/x");
    }

    proptest::proptest! {
        /// Without dots, escapes or parameters the form cuts at `?`/`#`,
        /// collapses every `//` and starts with `/`, for any path
        /// (multi-byte included); borrowed when that changes nothing.
        #[test]
        fn canonical_path_cuts_then_collapses(path in "[/?#aé]{0,12}") {
            let cut = path.find(['?', '#']).map_or(&*path, |end| &path[..end]);
            let mut collapsed = cut.to_owned();
            while collapsed.contains("//") {
                collapsed = collapsed.replace("//", "/");
            }
            if !collapsed.is_empty() && !collapsed.starts_with('/') {
                collapsed.insert(0, '/');
            }
            let got = canonical(&path);
            proptest::prop_assert_eq!(&*got, &*collapsed);
            proptest::prop_assert_eq!(matches!(got, Cow::Borrowed(_)), *cut == *collapsed);
        }

        /// Whatever a standard URL normaliser (the WHATWG parser of the
        /// `url` crate) makes of a path, the form makes the same of it,
        /// and the form of a form is itself. (Not for a dot segment with
        /// parameters, `..;x`: the WHATWG parser keeps it as a name, where
        /// Tomcat, Jetty and Spring serve it as `..`, as the form does.)
        #[test]
        fn a_normalised_variant_is_the_same_path(
            segments in proptest::collection::vec(
                proptest::sample::select(vec![
                    "a", "B", ".", "..", "%2e", "%2E%2e", "%61", "%7E", "x;p=1", "%2F", "%c3%A9", "", "%",
                ]),
                0..8,
            ),
            query in proptest::option::of("[a-z=&/.]{0,6}"),
        ) {
            let mut path = format!("/{}", segments.join("/"));
            if let Some(query) = query {
                path = format!("{path}?{query}");
            }
            let normalised = url::Url::parse(&format!("http://h{path}")).unwrap();
            let form = canonical(&path);
            proptest::prop_assert_eq!(&*canonical(normalised.path()), &*form, "{} -> {}", path, normalised.path());
            proptest::prop_assert_eq!(&*canonical(&form), &*form);
            for form_of in [PathForm { decode_slashes: true, ignore_case: true }, PathForm { decode_slashes: true, ignore_case: false }] {
                let once = canonical_path(&path, form_of);
                proptest::prop_assert_eq!(&*canonical_path(&once, form_of), &*once);
            }
        }
    }

    #[test]
    fn exact_beats_prefix_and_client_beats_any() {
        let s = snapshot(RULES);
        assert_eq!(id(&s, "/api/v1/playback", Some("ANDROID")), Some("exact-android"));
        assert_eq!(id(&s, "/api/v1/playback", Some("IOS")), Some("exact-any"));
        assert_eq!(id(&s, "/api/v1/playback", None), Some("exact-any"));
    }

    #[test]
    fn longest_prefix_wins_before_client_precedence() {
        let s = snapshot(RULES);
        // /api/v1/* (any client) is more specific than /api/* for IOS.
        assert_eq!(id(&s, "/api/v1/search", Some("IOS")), Some("v1-any"));
        assert_eq!(id(&s, "/api/v2/search", Some("IOS")), Some("api-ios"));
        assert_eq!(id(&s, "/api/v2/search", None), Some("api-any"));
    }

    #[test]
    fn client_only_rule_falls_through_for_other_clients() {
        let s = snapshot(RULES);
        assert_eq!(id(&s, "/ios-only", Some("IOS")), Some("ios-only"));
        assert_eq!(id(&s, "/ios-only", Some("ANDROID")), Some("catch-all"));
        assert_eq!(id(&s, "/elsewhere", None), Some("catch-all"));
    }

    #[test]
    fn no_rule_without_catch_all() {
        let s = snapshot("rules:\n  - { rule_id: a, resource_path: /a, limit: 1, window_seconds: 1 }\n");
        assert_eq!(id(&s, "/b", None), None);
        assert_eq!(id(&s, "/a/x", None), None, "exact paths do not match as prefixes");
    }

    #[test]
    fn multibyte_paths_do_not_panic() {
        let s =
            snapshot("rules:\n  - { rule_id: a, resource_path: \"/ab*\", limit: 1, window_seconds: 1 }\n");
        assert_eq!(id(&s, "/é", None), None);
        assert_eq!(id(&s, "/abé", None), Some("a"));
    }

    #[test]
    fn version_depends_on_content_not_layout() {
        let a = snapshot(RULES);
        let reordered: String = {
            let mut lines: Vec<&str> = RULES.lines().collect();
            lines[2..].reverse();
            lines.join("\n") + "\n# a comment\n"
        };
        let b = snapshot(&reordered);
        assert_eq!(a.version(), b.version());
        let c = snapshot(&RULES.replacen("limit: 1,", "limit: 2,", 1));
        assert_ne!(a.version(), c.version());
        // An algorithm change is a change: a reload must swap it in.
        let d = snapshot(&RULES.replacen("limit: 1,", "limit: 1, algorithm: gcra,", 1));
        assert_ne!(a.version(), d.version());
    }
}
