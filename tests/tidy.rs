//! Tidy checks: the architecture invariants of ARCHITECTURE.md, enforced on
//! the source text so they cannot drift into prose only.
//!
//! - The `use crate::` graph between top-level modules has no cycle, test
//!   modules included (a test that needs a higher module lives in `tests/`).
//! - Generated protobuf types (`api::pb`, `api::envoy_pb`) are named only
//!   under `src/api/`.
//! - Every module file starts with a `//!` doc.
//! - Telemetry imports no part: parts expose their figures through one
//!   trait (`telemetry::Figures`) the registry reads.
//! - No cycle between the files of one folder either (`super::x` and
//!   `crate::folder::x` references between siblings; `mod.rs` is the
//!   folder's interface and not a node).
//! - No function in `src/` (tests aside) is over 60 lines, but the few
//!   named in `LONG_FUNCTIONS` with why.
//! - ARCHITECTURE.md's module graph is the graph this file sees
//!   (`RATELIMITD_BLESS=1` rewrites it).
//! - Settings flow one way: each part owns its settings types and no part
//!   imports `config`, which composes, layers, validates and translates
//!   them for the entry points above (`server`, `cli`, `migrate`).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// `src/` of the checkout under test: the run-time `CARGO_MANIFEST_DIR`
/// (cargo and nextest set it), so a test binary reused from a shared target
/// dir built in another clone still reads this clone's sources.
fn src_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("src")
}

/// Every file and every folder under `dir` (hidden folders and `target`
/// left out), files first.
fn tree(dir: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    fn walk(dir: &Path, files: &mut Vec<PathBuf>, folders: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if !path.is_dir() {
                files.push(path);
            } else if !path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.') || n == "target")
            {
                folders.push(path.clone());
                walk(&path, files, folders);
            }
        }
    }
    let (mut files, mut folders) = (Vec::new(), Vec::new());
    walk(dir, &mut files, &mut folders);
    (files, folders)
}

fn source_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> =
        tree(&src_dir()).0.into_iter().filter(|path| path.extension().is_some_and(|e| e == "rs")).collect();
    files.sort();
    files
}

fn relative(path: &Path) -> String {
    path.strip_prefix(src_dir()).unwrap().to_string_lossy().into_owned()
}

/// The top-level module a file belongs to (`decision/envoy.rs` → `decision`).
fn module_of(path: &Path) -> String {
    let rel = relative(path);
    match rel.split_once('/') {
        Some((dir, _)) => dir.to_owned(),
        None => rel.trim_end_matches(".rs").to_owned(),
    }
}

/// The text without line comments.
fn code(text: &str) -> String {
    text.lines().filter(|line| !line.trim_start().starts_with("//")).flat_map(|line| [line, "\n"]).collect()
}

/// Top-level modules named after `crate::`, including every root of a
/// `use crate::{a::x, b::{y, z}}` group.
fn crate_references(code: &str) -> BTreeSet<String> {
    names_after(code, "crate::", false)
}

/// The first segments of the paths after `prefix` in `code`, each root of
/// a `prefix{…}` group included; with `paths_only`, only those the path
/// goes on from (`super::window::Verdict`, `super::{fallback::Failed, keys}`
/// → `window`, `fallback`): a module named, not an item
/// (`crate::rules::compile(…)` calls a function that shares its module's
/// name).
fn names_after(code: &str, prefix: &str, paths_only: bool) -> BTreeSet<String> {
    let ident_at = |from: usize| -> String {
        code[from..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
    };
    let goes_on = |end: usize| !paths_only || code[end..].starts_with("::");
    let mut out = BTreeSet::new();
    let mut at = 0;
    while let Some(found) = code[at..].find(prefix) {
        let start = at + found + prefix.len();
        at = start;
        // `xsuper::` or `a::super::` is not this prefix.
        let before = code[..start - prefix.len()].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        if !code[start..].starts_with('{') {
            let name = ident_at(start);
            if !name.is_empty() && goes_on(start + name.len()) {
                out.insert(name);
            }
            continue;
        }
        let bytes = code.as_bytes();
        let (mut depth, mut item_start, mut i) = (0, true, start);
        while i < bytes.len() {
            match bytes[i] {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                b',' if depth == 1 => item_start = true,
                c if depth == 1 && item_start && (c.is_ascii_alphabetic() || c == b'_') => {
                    let name = ident_at(i);
                    i += name.len();
                    if goes_on(i) {
                        out.insert(name);
                    }
                    item_start = false;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
    }
    out
}

#[test]
fn the_module_graph_has_no_cycle() {
    let files = source_files();
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(f)).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let from = module_of(file);
        if from == "lib" || from == "main" {
            continue;
        }
        for to in crate_references(&code(&fs::read_to_string(file).unwrap())) {
            if to != from && modules.contains(&to) {
                edges.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    // Depth-first search for a back edge, reporting the cycle it closes.
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    for module in edges.keys() {
        if let Some(cycle) = visit(module, &edges, &mut Vec::new(), &mut done) {
            panic!("module cycle: {}\nedges: {edges:#?}", cycle.join(" -> "));
        }
    }
    // The graph is not trivially empty: the parser sees the real edges.
    assert!(edges.get("api").is_some_and(|to| to.contains("decision")), "{edges:#?}");
    assert!(edges.get("dlq").is_some_and(|to| to.contains("decision")), "{edges:#?}");
}

/// The modules above the parts: they compose the configuration and wire
/// the parts (`config` itself, the server, the command line, `migrate`,
/// the admin console's server, and `release`, the publish path the command
/// line and the console share).
const ENTRY_POINTS: [&str; 8] = ["config", "server", "cli", "migrate", "main", "lib", "console", "release"];

/// The `use crate::` edges between top-level modules, per source file.
fn module_edges() -> Vec<(String, String, String)> {
    let files = source_files();
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(f)).collect();
    let mut out = Vec::new();
    for file in &files {
        let from = module_of(file);
        for to in crate_references(&code(&fs::read_to_string(file).unwrap())) {
            if to != from && modules.contains(&to) {
                out.push((relative(file), from.clone(), to));
            }
        }
    }
    out
}

#[test]
fn no_part_imports_config() {
    let offenders: Vec<String> = module_edges()
        .into_iter()
        .filter(|(_, from, to)| to == "config" && !ENTRY_POINTS.contains(&from.as_str()))
        .map(|(file, _, _)| format!("src/{file}"))
        .collect();
    assert!(
        offenders.is_empty(),
        "parts import config (a part owns its settings; config composes them): {offenders:?}"
    );
}

#[test]
fn telemetry_imports_no_part() {
    let offenders: Vec<String> = module_edges()
        .into_iter()
        .filter(|(_, from, _)| from == "telemetry")
        .map(|(file, _, to)| format!("src/{file} -> {to}"))
        .collect();
    assert!(
        offenders.is_empty(),
        "telemetry reaches into parts (they register Figures instead): {offenders:?}"
    );
}

/// Within each folder, the edges between sibling files: `super::x` or
/// `crate::folder::x` naming sibling `x` (a file `x.rs` or folder `x/`).
fn sibling_edges() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut folders: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for file in source_files() {
        let rel = relative(&file);
        let Some((folder, name)) = rel.rsplit_once('/') else { continue };
        // A folder's `mod.rs` is that folder's node among its parent's
        // files (its `super::` names the parent's siblings); any other
        // file is a node of its own folder, nested folders included.
        let (folder, me, dir, up) = match name {
            "mod.rs" => match folder.rsplit_once('/') {
                Some((parent, node)) => {
                    (parent, node.to_owned(), file.parent().unwrap().parent().unwrap(), "super::")
                }
                None => continue,
            },
            _ => (folder, name.trim_end_matches(".rs").to_owned(), file.parent().unwrap(), "super::"),
        };
        let siblings: BTreeSet<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().trim_end_matches(".rs").to_owned())
            .filter(|n| n != "mod")
            .collect();
        let text = code(&fs::read_to_string(&file).unwrap());
        let mut named = names_after(&text, up, true);
        named.extend(names_after(&text, &format!("crate::{}::", folder.replace('/', "::")), true));
        let edges = folders.entry(folder.to_owned()).or_default().entry(me.clone()).or_default();
        edges.extend(named.into_iter().filter(|n| *n != me && siblings.contains(n)));
    }
    folders
}

#[test]
fn no_cycle_inside_a_folder() {
    let mut cycles = Vec::new();
    for (folder, edges) in sibling_edges() {
        for (from, tos) in &edges {
            for to in tos {
                if edges.get(to).is_some_and(|back| back.contains(from)) && from < to {
                    cycles.push(format!("{folder}/{from}.rs <-> {folder}/{to}.rs"));
                }
            }
        }
        // Longer cycles: a file that reaches itself.
        for start in edges.keys() {
            let mut seen = BTreeSet::new();
            let mut stack: Vec<&String> = edges[start].iter().collect();
            while let Some(node) = stack.pop() {
                if node == start {
                    cycles.push(format!("{folder}/{start}.rs reaches itself"));
                    break;
                }
                if seen.insert(node.clone()) {
                    stack.extend(edges.get(node).into_iter().flatten());
                }
            }
        }
    }
    cycles.sort();
    cycles.dedup();
    assert!(cycles.is_empty(), "cycles between the files of a folder: {cycles:#?}");
    // The parser sees real sibling edges.
    let edges = sibling_edges();
    assert!(edges["limiter"]["redis"].contains("window"), "{:#?}", edges["limiter"]);
}

#[test]
fn names_after_see_paths_that_go_on_only() {
    let text = "use super::{a::X, b, c::{d, e}};\nfn f() { super::g::h(); crate::rules::compile(x); }\n";
    assert_eq!(names_after(text, "super::", true), ["a", "c", "g"].map(str::to_owned).into());
    assert!(names_after(text, "crate::rules::", true).is_empty(), "a function call names no module");
}

/// The most lines a function of `src/` spans, signature to closing brace.
const MAX_FUNCTION_LINES: usize = 60;

/// Functions allowed past [`MAX_FUNCTION_LINES`], as `file::name` (a
/// method: `file::Type::name`), each with why it reads better whole.
const LONG_FUNCTIONS: &[(&str, &str)] = &[
    ("src/server/mod.rs::run_observed", "the start sequence: one line per part, in dependency order"),
    ("src/rules/envoy/yaml.rs::load_level", "upstream's checks of one YAML level, in upstream's order"),
    ("src/rules/envoy/yaml.rs::compile_limit", "upstream's checks of one rate_limit, in upstream's order"),
    ("src/rules/store.rs::watch", "the poll loop and its once-per-change logging state"),
    (
        "src/rollout/subscribe.rs::Subscription::follow",
        "the blocking consumer loop and its fallback deadline",
    ),
    ("src/kafka.rs::read_topic", "the blocking consumer loop over assign/poll and its progress deadline"),
    (
        "src/tls.rs::ReloadingAcceptor::incoming",
        "the accept loop: one select over accepts, handshakes and stop",
    ),
];

/// Lines a file of `src/` may hold, its test module included: past it a
/// file holds several concerns, and its seams make folders.
const MAX_FILE_LINES: usize = 800;

/// Files allowed past [`MAX_FILE_LINES`], each with what it holds.
const LONG_FILES: &[(&str, &str)] = &[];

/// Files whose `impl Engine` blocks hold the engine's methods: its entry
/// points and the pipeline. Every other step is a function or a type of
/// its own file, so the folder check sees each call between files.
const ENGINE_METHOD_FILES: [&str; 2] = ["src/decision/mod.rs", "src/decision/pipeline.rs"];

#[test]
fn engine_methods_live_in_two_files() {
    let mut elsewhere = Vec::new();
    for file in source_files() {
        let rel = format!("src/{}", relative(&file));
        let text = code(&fs::read_to_string(&file).unwrap());
        let blocks =
            text.lines().filter(|line| line.starts_with("impl") && impl_type(line) == "Engine").count();
        if blocks > 0 && !ENGINE_METHOD_FILES.contains(&rel.as_str()) {
            elsewhere.push(format!("{rel}: {blocks} impl Engine block(s)"));
        }
    }
    assert!(
        elsewhere.is_empty(),
        "methods of Engine outside {ENGINE_METHOD_FILES:?} (make them functions of their file): {elsewhere:#?}"
    );
}

#[test]
fn no_file_is_over_eight_hundred_lines() {
    let mut over = Vec::new();
    let mut allowed_but_short = Vec::new();
    for file in source_files() {
        let rel = format!("src/{}", relative(&file));
        let lines = fs::read_to_string(&file).unwrap().lines().count();
        let allowed = LONG_FILES.iter().any(|(name, _)| *name == rel);
        if lines > MAX_FILE_LINES && !allowed {
            over.push(format!("{rel}: {lines} lines"));
        }
        if allowed && lines <= MAX_FILE_LINES {
            allowed_but_short.push(rel);
        }
    }
    assert!(over.is_empty(), "files over {MAX_FILE_LINES} lines (split them at their seams): {over:#?}");
    assert!(
        allowed_but_short.is_empty(),
        "allowed but no longer long: remove from LONG_FILES: {allowed_but_short:?}"
    );
    for (name, _) in LONG_FILES {
        assert!(common_path(name).exists(), "{name} is allowed but does not exist");
    }
}

fn common_path(name: &str) -> PathBuf {
    src_dir().parent().unwrap().join(name)
}

/// The type an `impl` line implements for: `impl<T> Trait for Type<T> {`
/// and `impl Type {` give `Type`.
fn impl_type(line: &str) -> String {
    let mut rest = line.trim_start_matches("impl").trim_start();
    if rest.starts_with('<') {
        // The impl's own generics, nested ones included.
        let mut depth = 0;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '<' => 1,
                    '>' => -1,
                    _ => 0,
                };
                depth == 0
            })
            .map_or(0, |(at, _)| at + 1);
        rest = rest[end..].trim_start();
    }
    if let Some((_, ty)) = rest.split_once(" for ") {
        rest = ty;
    }
    rest.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
        .collect::<String>()
        .rsplit("::")
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Every function of `src/` outside test modules: (`file::name`, or
/// `file::Type::name` for a method, and its lines).
fn function_lengths() -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for file in source_files() {
        // A test module of its own file (`#[cfg(test)] mod tests;`).
        if file.file_name().is_some_and(|name| name == "tests.rs") {
            continue;
        }
        let text = fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        // Test modules close the file: stop at the first.
        let end = lines.iter().position(|l| l.trim() == "#[cfg(test)]").unwrap_or(lines.len());
        let mut i = 0;
        // The type of the `impl` block being read, if any.
        let mut within: Option<String> = None;
        while i < end {
            let line = lines[i];
            let trimmed = line.trim_start();
            if line.starts_with("impl") {
                within = Some(impl_type(line));
            } else if line.starts_with('}') {
                within = None;
            }
            let after_vis = trimmed
                .strip_prefix("pub(crate) ")
                .or_else(|| trimmed.strip_prefix("pub(super) "))
                .or_else(|| trimmed.strip_prefix("pub "))
                .unwrap_or(trimmed);
            let after_kw = after_vis.strip_prefix("const ").unwrap_or(after_vis);
            let after_kw = after_kw.strip_prefix("async ").unwrap_or(after_kw);
            let Some(rest) = after_kw.strip_prefix("fn ") else {
                i += 1;
                continue;
            };
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let indent = line.len() - trimmed.len();
            // The body opens where the signature ends; a `;` first is a declaration.
            let mut open = i;
            while open < end
                && !lines[open].trim_end().ends_with('{')
                && !lines[open].trim_end().ends_with(';')
            {
                open += 1;
            }
            if open >= end || lines[open].trim_end().ends_with(';') {
                i += 1;
                continue;
            }
            let close = (open + 1..end)
                .find(|&k| {
                    let l = lines[k];
                    l.len() - l.trim_start().len() == indent && l.trim_start().starts_with('}')
                })
                .unwrap_or(end);
            let owner = match (&within, indent) {
                (Some(ty), 1..) => format!("{ty}::"),
                _ => String::new(),
            };
            out.push((format!("src/{}::{owner}{name}", relative(&file)), close - i + 1));
            i += 1;
        }
    }
    out
}

#[test]
fn no_function_is_over_sixty_lines() {
    let lengths = function_lengths();
    let over: Vec<String> = lengths
        .iter()
        .filter(|(name, n)| {
            *n > MAX_FUNCTION_LINES && !LONG_FUNCTIONS.iter().any(|(allowed, _)| allowed == name)
        })
        .map(|(name, n)| format!("{name}: {n} lines"))
        .collect();
    assert!(over.is_empty(), "functions over {MAX_FUNCTION_LINES} lines (split them by part): {over:#?}");
    // The allow-list names only functions that exist and are still long.
    for (name, why) in LONG_FUNCTIONS {
        assert!(!why.is_empty(), "{name}: say why");
        assert!(
            lengths.iter().any(|(n, len)| n == name && *len > MAX_FUNCTION_LINES),
            "{name} is allowed but no longer over {MAX_FUNCTION_LINES} lines: remove it from LONG_FUNCTIONS"
        );
    }
    // The scanner sees real functions.
    assert!(lengths.iter().any(|(n, _)| n == "src/limiter/mod.rs::evaluate"), "{lengths:?}");
}

const GRAPH_BEGIN: &str = "<!-- module graph: generated by tests/tidy.rs -->";
const GRAPH_END: &str = "<!-- end of module graph -->";

/// The top-level module graph as text: each module and the modules it
/// imports, in floors (a module is on the floor above the highest module
/// it imports; foundations, importing none, on floor 0).
fn graph_text() -> String {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in source_files() {
        edges.entry(module_of(&file)).or_default();
    }
    for (_, from, to) in module_edges() {
        edges.entry(from).or_default().insert(to);
    }
    edges.remove("lib");
    edges.remove("main");
    fn floor(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        memo: &mut BTreeMap<String, usize>,
    ) -> usize {
        if let Some(f) = memo.get(m) {
            return *f;
        }
        let f = edges.get(m).into_iter().flatten().map(|t| floor(t, edges, memo) + 1).max().unwrap_or(0);
        memo.insert(m.to_owned(), f);
        f
    }
    let mut memo = BTreeMap::new();
    let mut floors: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for m in edges.keys() {
        floors.entry(floor(m, &edges, &mut memo)).or_default().push(m.clone());
    }
    let mut out = String::from("```\n");
    for (f, modules) in floors.iter().rev() {
        for m in modules {
            let to: Vec<&str> = edges[m].iter().map(String::as_str).collect();
            let to = if to.is_empty() { "-".to_owned() } else { to.join(", ") };
            out.push_str(&format!("{f:>2}  {m:<10} -> {to}\n"));
        }
    }
    out.push_str("```");
    out
}

#[test]
fn architecture_draws_the_module_graph_as_it_is() {
    let path = src_dir().parent().unwrap().join("ARCHITECTURE.md");
    let text = fs::read_to_string(&path).unwrap();
    let (head, rest) = text.split_once(GRAPH_BEGIN).expect("ARCHITECTURE.md has the module graph's markers");
    let (drawn, tail) = rest.split_once(GRAPH_END).expect("the module graph's end marker");
    let graph = graph_text();
    if std::env::var_os("RATELIMITD_BLESS").is_some() {
        fs::write(&path, format!("{head}{GRAPH_BEGIN}\n{graph}\n{GRAPH_END}{tail}")).unwrap();
        return;
    }
    assert_eq!(
        drawn.trim(),
        graph,
        "ARCHITECTURE.md's module graph is stale (RATELIMITD_BLESS=1 cargo test --test tidy redraws it)"
    );
}

#[test]
fn crate_references_see_groups_and_paths() {
    let grouped = "use crate::{a::x, b::{y, z}, c};\nfn f() { crate::d::g(); }\n";
    assert_eq!(crate_references(grouped), ["a", "b", "c", "d"].map(str::to_owned).into());
    let commented = "// use crate::x;\nuse crate::a;\n";
    assert_eq!(crate_references(&code(commented)), ["a"].map(str::to_owned).into());
}

#[test]
fn generated_types_are_named_only_in_api() {
    let mut offenders = Vec::new();
    for file in source_files() {
        let rel = relative(&file);
        if rel.starts_with("api/") {
            continue;
        }
        let text = fs::read_to_string(&file).unwrap();
        for (number, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            let names_generated = code.contains("envoy_pb")
                || code.contains("api::pb")
                || (code.contains("api::{") && code.split(['{', ',', '}', ' ']).any(|part| part == "pb"));
            if names_generated {
                offenders.push(format!("src/{rel}:{}: {}", number + 1, line.trim()));
            }
        }
    }
    assert!(offenders.is_empty(), "generated protobuf types outside src/api/:\n{}", offenders.join("\n"));
}

#[test]
fn every_module_has_a_doc() {
    let missing: Vec<String> = source_files()
        .into_iter()
        .filter(|f| !fs::read_to_string(f).unwrap().trim_start().starts_with("//!"))
        .map(|f| relative(&f))
        .collect();
    assert!(missing.is_empty(), "modules without a //! doc: {missing:?}");
}

#[test]
fn impl_type_names_the_type_implemented_for() {
    assert_eq!(impl_type("impl Dispatcher {"), "Dispatcher");
    assert_eq!(impl_type("impl std::fmt::Debug for RedisStore {"), "RedisStore");
    assert_eq!(impl_type("impl<D: Descriptor<'a>> Subject for Rls<'_, '_, D> {"), "Rls");
}

/// What the names of ARCHITECTURE.md are checked against, read once.
struct Known {
    /// Every file's name in the repository (`mod.rs`, `decide_batch.lua`).
    files: BTreeSet<String>,
    /// The repository's Rust (`src/`, `tests/`, `benches/`,
    /// `loadtest/src/`, `build.rs`), its Lua and `clippy.toml`.
    source: String,
    /// The reference pages that name settings and rule fields.
    reference: String,
    /// Where a relative path may start: the root, `src/` and its folders.
    bases: Vec<PathBuf>,
    /// `Cargo.lock`, for crate names.
    lock: String,
}

impl Known {
    fn read() -> Self {
        let root = src_dir().parent().unwrap().to_path_buf();
        let read = |path: &Path| fs::read_to_string(path).unwrap_or_default();
        let files =
            tree(&root).0.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        let mut source: String = ["src", "tests", "benches", "loadtest/src"]
            .iter()
            .flat_map(|dir| tree(&root.join(dir)).0)
            .filter(|path| path.extension().is_some_and(|e| e == "rs" || e == "lua" || e == "toml"))
            .map(|path| read(&path))
            .collect();
        source.push_str(&read(&root.join("build.rs")));
        source.push_str(&read(&root.join("clippy.toml")));
        let reference = ["docs/configuration.md", "docs/rules.md", "docs/envoy.md"]
            .iter()
            .map(|doc| fs::read_to_string(root.join(doc)).unwrap())
            .collect();
        let mut bases = vec![root.clone(), src_dir()];
        bases.extend(tree(&src_dir()).1);
        let lock = fs::read_to_string(root.join("Cargo.lock")).unwrap();
        Known { files, source, reference, bases, lock }
    }

    /// What a backticked name of ARCHITECTURE.md must be to be true: a
    /// path (`decision/envoy/`, `src/main.rs`) that exists from the
    /// repository's root, from `src/` or from a folder of `src/` (the entry
    /// of a module names its own folders); a file name that some file has;
    /// an endpoint (`/readyz`) or a crate (`openssl-sys`) the source or the
    /// lock file names; a setting or rule field (`grpc.max_connections`)
    /// the reference names; or an identifier (`Engine::run`, `FailureSink`)
    /// whose last part the source holds as a word. `None`: something else
    /// (Rust syntax).
    fn missing(&self, name: &str) -> Option<String> {
        let plain = |c: char| c.is_ascii_alphanumeric() || "_./-:".contains(c);
        if name.is_empty() || !name.chars().all(plain) || name.contains("://") || name.starts_with('.') {
            return None;
        }
        if let Some(endpoint) = name.strip_prefix('/') {
            return (!self.source.contains(&format!("\"/{endpoint}"))).then(|| format!("endpoint {name}"));
        }
        if name.contains('-') && !name.contains('/') {
            return (!self.lock.contains(&format!("name = \"{name}\""))).then(|| format!("crate {name}"));
        }
        let extension = [".rs", ".md", ".lua", ".yml", ".yaml", ".toml", ".json", ".proto"];
        if name.contains('/') {
            let path = name.trim_end_matches('/');
            let exists = self.bases.iter().any(|base| base.join(path).exists());
            return (!exists).then(|| format!("path {name}"));
        }
        if extension.iter().any(|e| name.ends_with(e)) {
            return (!self.files.contains(name)).then(|| format!("file {name}"));
        }
        if name.contains('.') {
            let key = name.trim_end_matches(".*");
            let named = self.reference.contains(key) || self.source.contains(key);
            return (!named).then(|| format!("setting {name}"));
        }
        let (source, last) = (&self.source, name.rsplit("::").next().unwrap_or(name));
        let is_word_at = |at: usize| {
            let before = source[..at].chars().next_back();
            let after = source[at + last.len()..].chars().next();
            let ident = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            !ident(before) && !ident(after)
        };
        let found = source.match_indices(last).any(|(at, _)| is_word_at(at));
        (!found).then(|| format!("identifier {name}"))
    }
}

#[test]
fn architecture_names_only_what_exists() {
    let text = fs::read_to_string(src_dir().parent().unwrap().join("ARCHITECTURE.md")).unwrap();
    let known = Known::read();
    let mut missing = Vec::new();
    let mut checked = 0;
    for (i, part) in text.split('`').enumerate() {
        // Odd parts are inside backticks; a fenced block's lines are prose.
        if i % 2 == 0 || part.contains('\n') {
            continue;
        }
        checked += 1;
        missing.extend(known.missing(part));
    }
    missing.sort();
    missing.dedup();
    assert!(missing.is_empty(), "ARCHITECTURE.md names what does not exist: {missing:#?}");
    assert!(checked > 100, "the names were read ({checked})");
    // The check can fail (each name spelled in two pieces, so this file
    // does not hold it).
    for gone in [
        ["decision/fall", "back.rs"],
        ["Engine::rls_", "failed"],
        ["grpc.max_", "bogus"],
        ["/bo", "gus"],
        ["nonexistent-", "crate"],
    ] {
        assert!(known.missing(&gone.concat()).is_some(), "{gone:?}");
    }
    assert!(known.missing("Engine::run").is_none());
}
