//! Request headers as rules read them: a header's name as written in a
//! rule file, and its one value in a request, whatever case it was sent
//! in.

use std::collections::HashMap;

/// `written` as a header name (lower-case, letters, digits, `-` and
/// `_`), or `None` when it is not one.
pub(super) fn header_name(written: &str) -> Option<String> {
    let header = written.trim().to_ascii_lowercase();
    let valid =
        !header.is_empty() && header.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    valid.then_some(header)
}

/// The value of header `name` (lower-case) among `headers`, whatever the
/// case it was sent in; `None` when absent, or when variants of the name
/// carry different values (a caller may not choose which one counts).
pub fn header<'h>(headers: &'h HashMap<String, String>, name: &str) -> Option<&'h str> {
    let mut found: Option<&'h str> = None;
    for (written, value) in headers {
        if written.eq_ignore_ascii_case(name) {
            match found {
                Some(seen) if seen != value => return None,
                _ => found = Some(value),
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_has_one_value_whatever_its_case() {
        assert_eq!(header_name(" X-Team_Id "), Some("x-team_id".to_owned()));
        assert_eq!((header_name("x team"), header_name("")), (None, None));
        let headers = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect()
        };
        assert_eq!(header(&headers(&[("X-Team", "a")]), "x-team"), Some("a"));
        assert_eq!(header(&headers(&[("X-Team", "a"), ("x-team", "a")]), "x-team"), Some("a"));
        assert_eq!(header(&headers(&[("X-Team", "a"), ("x-team", "b")]), "x-team"), None);
        assert_eq!(header(&headers(&[("x-other", "a")]), "x-team"), None);
    }
}
