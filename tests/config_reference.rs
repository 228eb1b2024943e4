//! `docs/configuration.md`'s table of keys is generated from the settings
//! types themselves: every key the configuration accepts (the fields of
//! `Config` and of the sections it composes, found in `src/`), the doc
//! comment of its field as its meaning, and its value in
//! `Config::default()` as its default. The test fails when the file says
//! anything else (a key missing, stale or described differently);
//! `RATELIMITD_BLESS=1 cargo test --test config_reference` rewrites the
//! table from the types.

use std::{collections::HashMap, fs, path::PathBuf};

use ratelimitd::config::Config;

mod common;

fn repo() -> PathBuf {
    common::repo_path("")
}

/// One field of a settings struct: its name, doc comment and type, and
/// the default its doc comment states (a last paragraph `Default: …`, for
/// a default resolved at load, such as a path in the state directory).
#[derive(Debug)]
struct Field {
    name: String,
    doc: String,
    ty: String,
    default: Option<String>,
    /// `#[serde(flatten)]`: its type's keys are this struct's own.
    flatten: bool,
}

/// Every `pub struct` of `src/` with named fields, by name.
fn structs() -> HashMap<String, Vec<Field>> {
    let mut out = HashMap::new();
    for path in common::rust_sources() {
        parse(&fs::read_to_string(&path).unwrap(), &mut out);
    }
    out
}

fn parse(text: &str, out: &mut HashMap<String, Vec<Field>>) {
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.strip_prefix("pub struct ") else { continue };
        let Some(name) = rest.strip_suffix(" {") else { continue };
        let (mut fields, mut doc, mut skipped, mut flatten) = (Vec::new(), Vec::new(), false, false);
        for line in lines.by_ref() {
            if line == "}" {
                break;
            }
            let line = line.trim();
            if let Some(text) = line.strip_prefix("///") {
                doc.push(text.trim().to_owned());
            } else if line.starts_with("#[serde(skip)]") {
                skipped = true;
            } else if line.starts_with("#[serde(flatten)]") {
                flatten = true;
            } else if let Some(field) = line.strip_prefix("pub ") {
                if let Some((field, ty)) = field.split_once(": ")
                    && !skipped
                {
                    let doc = doc.join(" ").split_whitespace().collect::<Vec<_>>().join(" ");
                    let (doc, default) = match doc.split_once("Default: ") {
                        Some((doc, default)) => (doc.trim().to_owned(), Some(default.trim().to_owned())),
                        None => (doc, None),
                    };
                    let ty = ty.trim_end_matches(',').to_owned();
                    fields.push(Field { name: field.to_owned(), doc, ty, default, flatten });
                }
                doc.clear();
                (skipped, flatten) = (false, false);
            }
        }
        out.insert(name.to_owned(), fields);
    }
}

/// `value` as the table's default column.
fn default_of(value: Option<&serde_json::Value>) -> String {
    use serde_json::Value;
    match value {
        None | Some(Value::Null) => "unset".to_owned(),
        Some(Value::String(s)) if s.is_empty() => "empty".to_owned(),
        Some(Value::String(s)) => format!("`{s}`"),
        Some(Value::Array(a)) if a.is_empty() => "none".to_owned(),
        Some(Value::Object(o)) if o.is_empty() => "none".to_owned(),
        // An f32 widened: its shortest form (0.8, not 0.800000011920929).
        Some(Value::Number(n))
            if n.as_f64().is_some_and(|f| f64::from(f as f32) == f && !n.is_i64() && !n.is_u64()) =>
        {
            format!("`{}`", n.as_f64().unwrap() as f32)
        }
        Some(other) => format!("`{other}`"),
    }
}

/// The table's rows: every key under `prefix` of the struct `name`.
fn rows(
    structs: &HashMap<String, Vec<Field>>,
    name: &str,
    prefix: &str,
    defaults: &serde_json::Value,
    out: &mut Vec<String>,
) {
    for field in &structs[name] {
        if field.flatten {
            rows(structs, &field.ty, prefix, defaults, out);
            continue;
        }
        let key = format!("{prefix}{}", field.name);
        let value = defaults.get(&field.name);
        if structs.contains_key(&field.ty) {
            rows(structs, &field.ty, &format!("{key}."), value.unwrap_or(&serde_json::Value::Null), out);
        } else {
            assert!(!field.doc.is_empty(), "`{key}` has no doc comment: its meaning is the reference");
            let doc = field.doc.replace('|', "\\|");
            let default = field.default.clone().unwrap_or_else(|| default_of(value));
            out.push(format!("| `{key}` | {doc} | {default} |"));
        }
    }
}

const BEGIN: &str =
    "<!-- generated from the settings types by tests/config_reference.rs: edit the doc comments -->";
const END: &str = "<!-- end of generated table -->";

fn table() -> String {
    let structs = structs();
    let defaults = serde_json::to_value(Config::default()).unwrap();
    let mut out = vec!["| key | meaning | default |".to_owned(), "|---|---|---|".to_owned()];
    rows(&structs, "Config", "", &defaults, &mut out);
    out.join("\n")
}

#[test]
fn the_reference_is_what_the_settings_types_say() {
    let path = repo().join("docs/configuration.md");
    let text = fs::read_to_string(&path).unwrap();
    let (head, rest) =
        text.split_once(BEGIN).expect("docs/configuration.md has the generated table's markers");
    let (current, tail) = rest.split_once(END).expect("the generated table's end marker");
    let table = table();
    if std::env::var_os("RATELIMITD_BLESS").is_some() {
        fs::write(&path, format!("{head}{BEGIN}\n{table}\n{END}{tail}")).unwrap();
        return;
    }
    let current: Vec<&str> = current.trim().lines().collect();
    let wanted: Vec<&str> = table.lines().collect();
    let stale: Vec<&&str> = current.iter().filter(|l| !wanted.contains(l)).collect();
    let missing: Vec<&&str> = wanted.iter().filter(|l| !current.contains(l)).collect();
    assert!(
        stale.is_empty() && missing.is_empty(),
        "docs/configuration.md differs from the settings types (RATELIMITD_BLESS=1 cargo test --test config_reference rewrites it)\nstale:\n{}\nmissing:\n{}",
        stale.iter().map(|l| l.to_string()).collect::<Vec<_>>().join("\n"),
        missing.iter().map(|l| l.to_string()).collect::<Vec<_>>().join("\n"),
    );
    assert!(wanted.len() > 100, "the generator sees the keys ({})", wanted.len());
}

/// Every key the table names is one the configuration accepts: set through
/// the environment, it loads (a stale key would be refused as unknown).
#[test]
fn every_key_in_the_table_is_accepted() {
    let structs = structs();
    let defaults = serde_json::to_value(Config::default()).unwrap();
    let mut out = Vec::new();
    rows(&structs, "Config", "", &defaults, &mut out);
    for row in &out {
        let key = row.split('`').nth(1).unwrap();
        let env = [(format!("RATELIMITD__{}", key.to_uppercase().replace('.', "__")), "x".to_owned())];
        let error =
            Config::load(None, env.into_iter().collect()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(!error.contains("unknown field"), "{key}: {error}");
    }
}

/// Each field is described in its own words: no two fields share a text
/// (a copied doc comment describes at most one of them). Keys of one type
/// used twice (`redis.url`, `global.redis.url`) are one field.
#[test]
fn every_key_has_its_own_description() {
    /// The fields of `name` and of the sections under it, each once.
    fn walk<'a>(
        structs: &'a HashMap<String, Vec<Field>>,
        name: &'a str,
        out: &mut Vec<(&'a str, &'a Field)>,
    ) {
        for field in &structs[name] {
            if structs.contains_key(&field.ty) {
                walk(structs, &field.ty, out);
            } else if !out.iter().any(|(n, f)| *n == name && f.name == field.name) {
                out.push((name, field));
            }
        }
    }
    let structs = structs();
    let mut fields = Vec::new();
    walk(&structs, "Config", &mut fields);
    let mut seen: HashMap<&str, String> = HashMap::new();
    for (name, field) in fields {
        if let Some(first) = seen.insert(&field.doc, format!("{name}.{}", field.name)) {
            panic!("`{first}` and `{name}.{}` share one description: {}", field.name, field.doc);
        }
    }
}
