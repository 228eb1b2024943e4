//! The process's memory limit, from its cgroup: what the request byte
//! budget is a fraction of by default.

use std::path::Path;

/// A cgroup v1 limit at or above this is "no limit" (v1 writes the
/// largest page-aligned `i64`, 9223372036854771712).
const UNLIMITED_FROM: u64 = 1 << 62;

/// What part of the memory limit the request byte budget is by default:
/// what requests make the service hold stays under twice the budget
/// (docs/hostile-input.md), a quarter of the limit, leaving the rest to
/// the counters, the rules and the runtime.
pub const BUDGET_FRACTION: u64 = 8;

/// The memory limit of the cgroup at `root` in bytes: cgroup v2's
/// `memory.max`, else v1's `memory/memory.limit_in_bytes`; `None` when
/// neither is readable or the limit is unset (`max`).
pub fn memory_limit(root: &Path) -> Option<u64> {
    [root.join("memory.max"), root.join("memory/memory.limit_in_bytes")]
        .iter()
        .find_map(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| parse(&text))
}

fn parse(text: &str) -> Option<u64> {
    text.trim().parse::<u64>().ok().filter(|&limit| limit > 0 && limit < UNLIMITED_FROM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v2_limit_is_read_and_max_is_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(memory_limit(dir.path()), None, "no file: no limit");
        std::fs::write(dir.path().join("memory.max"), "1073741824\n").unwrap();
        assert_eq!(memory_limit(dir.path()), Some(1 << 30));
        std::fs::write(dir.path().join("memory.max"), "max\n").unwrap();
        assert_eq!(memory_limit(dir.path()), None);
    }

    #[test]
    fn a_v1_limit_is_read_and_its_unlimited_value_is_none() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("memory")).unwrap();
        let file = dir.path().join("memory/memory.limit_in_bytes");
        std::fs::write(&file, "536870912\n").unwrap();
        assert_eq!(memory_limit(dir.path()), Some(512 << 20));
        std::fs::write(&file, "9223372036854771712\n").unwrap();
        assert_eq!(memory_limit(dir.path()), None);
    }
}
