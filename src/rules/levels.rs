//! Levels (`levels:`): further keys a rule's limits are charged to
//! besides the user, each read from a request header, so one request is
//! charged to its key, its team and its organisation at once, all or
//! nothing. Checked here: the names, the headers, and that every limit's
//! `level:` names one of them.

use std::sync::Arc;

use super::{
    headers::header_name,
    model::{AlsoLimit, LevelKey, Levels, MAX_LEVELS},
    native::RawRule,
};
use crate::limiter::window::Algorithm;

/// The level every limit is charged to unless it names another: the
/// `Check`'s `user_id`.
pub const USER: &str = "user";

/// Longest level name.
pub const MAX_LEVEL_NAME_BYTES: usize = 32;

/// A rule's levels and the level its first limit is charged to.
pub(super) type Charged = (Option<Arc<Levels>>, Option<usize>);

/// The rule's levels and the level of its first limit; sets each of
/// `also`'s. An error names the field (`levels.team`, `also[1].level`).
pub(super) fn compile(
    raw: &RawRule,
    algorithm: Algorithm,
    also: &mut [AlsoLimit],
) -> Result<Charged, (String, String)> {
    let charged = |level: &Option<String>| level.as_deref().is_some_and(|name| name != USER);
    let named = charged(&raw.level) || raw.also.iter().any(|a| charged(&a.level));
    if raw.levels.is_empty() {
        if !named {
            return Ok((None, None));
        }
        let field = match charged(&raw.level) {
            true => "level".to_owned(),
            false => format!("also[{}].level", raw.also.iter().position(|a| charged(&a.level)).unwrap_or(0)),
        };
        return Err((field, format!("the rule declares no `levels:`; every limit is charged to the {USER}")));
    }
    conflicts(raw, algorithm, also).map_err(|message| ("levels".to_owned(), message))?;
    if raw.levels.len() > MAX_LEVELS {
        return Err(("levels".to_owned(), format!("at most {MAX_LEVELS} levels")));
    }
    let keys = keys(raw)?;
    let index_of = |name: Option<&str>, field: String| match name {
        None | Some(USER) => Ok(None),
        Some(name) => keys.iter().position(|key| &*key.name == name).map(Some).ok_or_else(|| {
            let names: Vec<&str> = keys.iter().map(|key| &*key.name).collect();
            (field, format!("{name:?} is not one of the rule's levels ({USER}, {})", names.join(", ")))
        }),
    };
    let level = index_of(raw.level.as_deref(), "level".to_owned())?;
    for (i, (limit, written)) in also.iter_mut().zip(&raw.also).enumerate() {
        limit.level = index_of(written.level.as_deref(), format!("also[{i}].level"))?;
    }
    for (index, key) in keys.iter().enumerate() {
        if level != Some(index) && also.iter().all(|limit| limit.level != Some(index)) {
            let message = "no limit is charged to it: name it in a limit's `level:`".to_owned();
            return Err((format!("levels.{}", key.name), message));
        }
    }
    let group = format!("~{}", raw.rule_id).into_boxed_str();
    Ok((Some(Arc::new(Levels { group, keys })), level))
}

/// The levels declared (`levels:`), checked, in name order.
fn keys(raw: &RawRule) -> Result<Vec<LevelKey>, (String, String)> {
    let mut keys = Vec::with_capacity(raw.levels.len());
    for (name, header) in &raw.levels {
        let at = format!("levels.{name}");
        if !well_formed(name) {
            let message = format!(
                "{name:?}: a level's name is lower-case letters, digits and '_', starting with a letter (at most {MAX_LEVEL_NAME_BYTES} bytes)"
            );
            return Err((at, message));
        }
        if name == USER {
            return Err((
                at,
                format!("{USER:?} is the Check's user_id, every limit's level unless it names another"),
            ));
        }
        let header =
            header_name(header).ok_or_else(|| (at.clone(), format!("{header:?} is not a header name")))?;
        if let Some(other) = keys.iter().find(|key: &&LevelKey| *key.header == *header) {
            return Err((at, format!("header {header:?} is level {}'s too", other.name)));
        }
        keys.push(LevelKey { name: Arc::from(name.as_str()), header: header.into_boxed_str() });
    }
    Ok(keys)
}

/// What levels cannot be combined with: their counters are counted and
/// shared out per user.
fn conflicts(raw: &RawRule, algorithm: Algorithm, also: &[AlsoLimit]) -> Result<(), String> {
    if raw.adaptive.is_some() {
        Err("an adaptive limit follows its users' reported outcomes: a rule with levels cannot be adaptive"
            .to_owned())
    } else if raw.global {
        Err("a global limit's grants are shared out per user: a rule with levels cannot be global".to_owned())
    } else if algorithm.releases() || also.iter().any(|a| a.window.algorithm.releases()) {
        Err("a limit of requests in flight (algorithm: concurrency) is the user's alone".to_owned())
    } else {
        Ok(())
    }
}

/// Whether `name` is a level's name: lower-case letters, digits and `_`,
/// starting with a letter.
fn well_formed(name: &str) -> bool {
    name.len() <= MAX_LEVEL_NAME_BYTES
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::rules::{PathForm, Snapshot, compile, native::parse};

    fn compiled(extra: &str) -> Result<Snapshot, String> {
        let text = format!(
            "rules:\n  - rule_id: llm\n    resource_path: /v1/*\n    limit: 100\n    window_seconds: 60\n{extra}"
        );
        let rules = parse(Path::new("r.yaml"), &text).map_err(|e| e.to_string())?;
        compile(Path::new("r.yaml"), rules, PathForm::default())
            .map_err(|errors| errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))
    }

    const TEAM_ORG: &str = "    levels: { team: X-Team-Id, org: x-org }\n    also:\n      - { limit: 1000, window_seconds: 60, level: team }\n      - { limit: 5000, period: month, unit: cost, level: org }\n";

    #[test]
    fn levels_name_a_header_each_and_every_limit_its_level() {
        let snapshot = compiled(TEAM_ORG).unwrap();
        let rule = &snapshot.rules()[0];
        let levels = rule.levels.as_deref().unwrap();
        assert_eq!(&*levels.group, "~llm");
        let keys: Vec<(&str, &str)> = levels.keys.iter().map(|k| (&*k.name, &*k.header)).collect();
        assert_eq!(keys, [("org", "x-org"), ("team", "x-team-id")], "in name order, headers lower-case");
        let names: Vec<Option<&str>> = (0..3).map(|i| rule.level_name_at(i).map(|n| &**n)).collect();
        assert_eq!(names, [None, Some("team"), Some("org")]);
        assert!(rule.counts_a_job());
        let first = compiled(&format!("    level: team\n{TEAM_ORG}")).unwrap();
        assert_eq!(first.rules()[0].level_name_at(0).map(|n| &**n), Some("team"));
        let user = compiled("    level: team\n    levels: { team: x-t }\n    also: [ { limit: 5, window_seconds: 1, level: user } ]\n")
            .unwrap();
        assert_eq!((user.rules()[0].level_at(0), user.rules()[0].level_at(1)), (Some(0), None));
    }

    #[test]
    fn each_bad_level_is_named() {
        let cases = [
            (
                TEAM_ORG.replace("level: org", "level: dept"),
                "also[1].level",
                "\"dept\" is not one of the rule's levels (user, org, team)",
            ),
            ("    level: team\n".to_owned(), "field `level`", "declares no `levels:`"),
            (
                "    also: [ { limit: 5, window_seconds: 1, level: team } ]\n".to_owned(),
                "also[0].level",
                "no `levels:`",
            ),
            (TEAM_ORG.replace(", level: org", ""), "levels.org", "no limit is charged to it"),
            (TEAM_ORG.replace("org: x-org", "Org: x-org"), "levels.Org", "a level's name is lower-case"),
            (TEAM_ORG.replace("org: x-org", "user: x-org"), "levels.user", "the Check's user_id"),
            (TEAM_ORG.replace("x-org", "'x org'"), "levels.org", "is not a header name"),
            (
                TEAM_ORG.replace("x-org", "x-team-id"),
                "levels.team",
                "header \"x-team-id\" is level org's too",
            ),
            (
                format!("    adaptive: {{ min: 50, max: 200 }}\n{TEAM_ORG}"),
                "field `levels`",
                "cannot be adaptive",
            ),
            (format!("    global: true\n{TEAM_ORG}"), "field `levels`", "cannot be global"),
            (
                "    algorithm: concurrency\n    level: a\n    levels: { a: x-a }\n".to_owned(),
                "field `levels`",
                "requests in flight",
            ),
            (
                "    levels: { a: x-a, b: x-b, c: x-c, d: x-d, e: x-e }\n    level: a\n".to_owned(),
                "field `levels`",
                "at most 4 levels",
            ),
        ];
        for (extra, field, message) in cases {
            let error = compiled(&extra).unwrap_err();
            assert!(error.contains(field) && error.contains(message), "{extra}: {error}");
        }
    }

    #[test]
    fn levels_are_part_of_the_rules_version() {
        let version = |extra: &str| compiled(extra).unwrap().version().to_owned();
        let base = version(TEAM_ORG);
        assert_ne!(base, version(&TEAM_ORG.replace("x-org", "x-organisation")));
        let swapped = TEAM_ORG
            .replace("60, level: team", "60, level: org")
            .replace("cost, level: org", "cost, level: team");
        assert_ne!(base, version(&swapped));
        assert_ne!(base, version(&format!("    level: org\n{TEAM_ORG}")));
        assert_eq!(version(""), version("    level: user\n"), "the default, written or not");
    }
}
