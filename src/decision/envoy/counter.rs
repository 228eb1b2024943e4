//! The counter keys of a descriptor: its window, its entries percent-encoded
//! so distinct entry lists never share a counter, and a digest past the
//! bounds.

use std::{borrow::Cow, fmt::Write as _, sync::Arc};

use crate::{
    decision::keys,
    limiter::{decoded, push_encoded},
};

/// The counter of one descriptor: its window in seconds and its entries, each as
/// `key=value` with `%`, `=`, `|` and `*` percent-encoded so distinct entry
/// lists never share a counter. An entry matched through a `share_threshold`
/// wildcard contributes the pattern instead of its value (`shared`), so all
/// of its values share the counter. A key or value over `max_bytes` is
/// counted by its digest ([`keys::bounded`]), and a whole key over
/// [`keys::MAX_COUNTER_KEY_BYTES`] is digested by [`bounded_key`]; the flag
/// says an entry was.
pub(super) fn raw_counter_key<'a>(
    window_seconds: u64,
    entries: impl Iterator<Item = (&'a str, &'a str)> + Clone,
    shared: &[(usize, Arc<str>)],
    max_bytes: usize,
) -> (String, bool) {
    let bound = |text: &'a str| keys::bounded(text, max_bytes);
    let mut key = String::with_capacity(
        16 + entries.clone().map(|(k, v)| k.len().min(72) + v.len().min(72) + 2).sum::<usize>(),
    );
    let mut digested = false;
    let _ = write!(key, "{window_seconds}");
    for (index, (name, value)) in entries.enumerate() {
        key.push('|');
        let name = bound(name);
        digested |= matches!(name, Cow::Owned(_));
        escape_into(&mut key, &name);
        key.push('=');
        match shared.iter().find(|(i, _)| *i == index) {
            // `*` is escaped too, so a shared pattern never equals a value.
            Some((_, pattern)) => {
                key.push('*');
                escape_into(&mut key, pattern);
            }
            None => {
                let value = bound(value);
                digested |= matches!(value, Cow::Owned(_));
                escape_into(&mut key, &value);
            }
        }
    }
    (key, digested)
}

/// `key`, or its digest when it is over [`keys::MAX_COUNTER_KEY_BYTES`]
/// (never equal to a short key: those start with the window's digits); the
/// flag says the digest was taken.
pub(super) fn bounded_key(key: String) -> (String, bool) {
    if key.len() > keys::MAX_COUNTER_KEY_BYTES {
        return (keys::digest_bytes(key.as_bytes()), true);
    }
    (key, false)
}

/// A counter key's entries read back: names and values.
pub(crate) type Entries<'a> = Vec<(Cow<'a, str>, Cow<'a, str>)>;

/// The window (seconds) and the entries of a first counter key that
/// [`raw_counter_key`] wrote without sharing: `None` for a key digested
/// as a whole, an extra limit's key (`seconds+slot|…`), a shared entry's
/// pattern (`=*`) or anything else it never writes. An entry digested on
/// its own reads back as its digest (`#sha256:…`, which no value is).
pub(crate) fn parse_counter_key(key: &str) -> Option<(u64, Entries<'_>)> {
    let mut parts = key.split('|');
    let seconds = parts.next().filter(|s| s.bytes().all(|b| b.is_ascii_digit()))?.parse().ok()?;
    let entries = parts
        .map(|entry| {
            let (name, value) = entry.split_once('=')?;
            if value.starts_with('*') {
                return None;
            }
            Some((decoded(name)?, decoded(value)?))
        })
        .collect::<Option<Vec<_>>>()?;
    Some((seconds, entries))
}

/// Separators of the counter key format, encoded inside names and values.
const KEY_SEPARATORS: [char; 3] = ['=', '|', '*'];

fn escape_into(out: &mut String, text: &str) {
    push_encoded(out, text, &KEY_SEPARATORS);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::envoy::Unit;

    /// A descriptor's first counter key, as `plan::items` makes it.
    fn counter_key<'a>(
        window_seconds: u64,
        entries: impl Iterator<Item = (&'a str, &'a str)> + Clone,
        shared: &[(usize, Arc<str>)],
        max_bytes: usize,
    ) -> (String, bool) {
        let (raw, digested) = raw_counter_key(window_seconds, entries, shared, max_bytes);
        let (key, whole) = bounded_key(raw);
        (key, digested || whole)
    }

    #[test]
    fn counter_keys_never_collide() {
        let a = counter_key(Unit::Second.seconds(), [("a", "b|c=d")].into_iter(), &[], 1_024).0;
        let b = counter_key(Unit::Second.seconds(), [("a", "b"), ("c", "d")].into_iter(), &[], 1_024).0;
        assert_ne!(a, b);
        assert_eq!(b, "1|a=b|c=d");
        assert_ne!(
            counter_key(Unit::Second.seconds(), [("a", "b")].into_iter(), &[], 1_024).0,
            counter_key(Unit::Minute.seconds(), [("a", "b")].into_iter(), &[], 1_024).0
        );
    }

    #[test]
    fn shared_entries_key_by_pattern_and_never_meet_a_value() {
        let shared = [(0, Arc::from("files/*"))];
        let a = counter_key(Unit::Minute.seconds(), [("files", "files/a.pdf")].into_iter(), &shared, 1_024).0;
        let b = counter_key(Unit::Minute.seconds(), [("files", "files/b.csv")].into_iter(), &shared, 1_024).0;
        assert_eq!(a, b);
        assert_eq!(a, "60|files=*files/%2A");
        // The literal value "files/*" (or "*files/*") counted without sharing is another counter.
        assert_ne!(a, counter_key(Unit::Minute.seconds(), [("files", "files/*")].into_iter(), &[], 1_024).0);
        assert_ne!(a, counter_key(Unit::Minute.seconds(), [("files", "*files/*")].into_iter(), &[], 1_024).0);
        // Only the shared entry is replaced.
        let nested = counter_key(
            Unit::Second.seconds(),
            [("user", "u1"), ("path", "/x")].into_iter(),
            &[(0, Arc::from("u*"))],
            1_024,
        )
        .0;
        assert_eq!(nested, "1|user=*u%2A|path=/x");
    }

    #[test]
    fn first_counter_keys_read_back_as_their_entries() {
        let entries = [("limitador", "ab12"), ("descriptors[0]['user']", "a|b=c*d%e|%41"), ("x", "")];
        let (key, _) = counter_key(60, entries.into_iter(), &[], 1_024);
        let (seconds, read) = parse_counter_key(&key).expect("a first counter key");
        assert_eq!(seconds, 60);
        let read: Vec<(&str, &str)> = read.iter().map(|(k, v)| (&**k, &**v)).collect();
        assert_eq!(read, entries);
        // A long value reads back as its digest; a key digested whole, a
        // shared pattern and an extra limit's key do not read back.
        let long = "v".repeat(300);
        let (key, _) = counter_key(1, [("a", &*long)].into_iter(), &[], 256);
        assert!(parse_counter_key(&key).unwrap().1[0].1.starts_with("#sha256:"));
        let (key, _) = counter_key(1, [("a", &*long), ("b", &*long)].into_iter(), &[], 1_024);
        assert_eq!(parse_counter_key(&key), None);
        let (key, _) = counter_key(60, [("files", "a")].into_iter(), &[(0, Arc::from("f*"))], 1_024);
        assert_eq!(parse_counter_key(&key), None);
        for written_by_no_one in ["60+1|a=b", "x|a=b", "60|a", "60|a=%4", "60|a=%zz", "60|a=%+1", "60|a=%C3"]
        {
            assert_eq!(parse_counter_key(written_by_no_one), None, "{written_by_no_one}");
        }
    }

    #[test]
    fn long_keys_are_stored_by_a_digest_of_the_whole_key() {
        let long = "v".repeat(400);
        let (a, digested) =
            counter_key(Unit::Second.seconds(), [("a", &*long), ("b", &*long)].into_iter(), &[], 1_024);
        assert!(digested);
        assert_eq!(a.len(), 72);
        let (b, _) = counter_key(Unit::Second.seconds(), [("a", &*long), ("b", "w")].into_iter(), &[], 1_024);
        assert_eq!(b.len(), 2 + 2 + 400 + 4, "under the bound: kept as it is");
        let (c, _) =
            counter_key(Unit::Minute.seconds(), [("a", &*long), ("b", &*long)].into_iter(), &[], 1_024);
        assert_ne!(a, c, "the unit is part of what is digested");
    }
}
