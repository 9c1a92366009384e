//! serde's and config-rs's error messages in a user's words: Rust's type names (`u64`,
//! `f32`, `struct ModelToml`, `enum Schedule`) as what they accept, "got" for serde's
//! "invalid type/value", and config-rs's own ` for key `…`` suffix dropped (the caller names
//! the key). Shared by configuration files (the engine) and request bodies (the server).

/// `message` (one serde or config-rs error's text) in the words of the file or request the
/// user wrote.
pub fn plain(message: &str) -> String {
    let mut s = message.to_string();
    if let Some(at) = s.rfind(" for key `") {
        s.truncate(at);
    }
    for (rust, words) in [
        ("usize", "a non-negative integer"),
        ("u64", "a non-negative integer"),
        ("u32", "a non-negative integer"),
        ("u16", "a non-negative integer"),
        ("u8", "a non-negative integer"),
        ("isize", "an integer"),
        ("i64", "an integer"),
        ("i32", "an integer"),
        ("f64", "a number"),
        ("f32", "a number"),
        (
            "an unsigned 64 bit or less integer",
            "a non-negative integer",
        ),
        ("a signed 64 bit or less integer", "an integer"),
        ("a floating point", "a number"),
        ("a boolean", "`true` or `false`"),
    ] {
        let typed = format!("expected {rust}");
        if let Some(at) = s.find(&typed) {
            let end = at + typed.len();
            // Only the whole name (`u8` is not the start of `u80`).
            if !s[end..].starts_with(|c: char| c.is_ascii_alphanumeric()) {
                s.replace_range(at..end, &format!("expected {words}"));
            }
        }
    }
    for (rust, words) in [
        ("expected struct ", "expected an object"),
        ("expected enum ", "expected a string"),
    ] {
        if let Some(at) = s.find(rust) {
            let from = at + rust.len();
            let end = s[from..]
                .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                .map_or(s.len(), |e| from + e);
            s.replace_range(at..end, words);
        }
    }
    s = s
        .replace("expected string or map", "expected a string")
        .replace("expected a map", "expected an object")
        .replace("expected a sequence", "expected a list");
    // config-rs's enum wording, where serde's own (`unknown variant …, expected …`) was not had.
    if let (Some(0), Some(at)) = (
        s.find("enum "),
        s.find(" does not have variant constructor "),
    ) {
        let value = s[at + 35..].to_string();
        s = format!("unknown value `{value}`");
    }
    for serde_words in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = s.strip_prefix(serde_words) {
            s = format!("got {rest}");
        }
    }
    for (serde_words, words) in [("got sequence", "got a list"), ("got map", "got an object")] {
        if let Some(rest) = s.strip_prefix(serde_words) {
            s = format!("{words}{rest}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::plain;

    #[test]
    fn rust_type_names_become_what_they_accept() {
        assert_eq!(
            plain("invalid type: string \"fast\", expected f64"),
            "got string \"fast\", expected a number"
        );
        assert_eq!(
            plain("invalid value: integer `-2`, expected u64"),
            "got integer `-2`, expected a non-negative integer"
        );
        // config-rs's wording, with its key suffix.
        assert_eq!(
            plain(
                "invalid type: 64-bit integer `-2`, expected an unsigned 64 bit or less integer for key `train.steps`"
            ),
            "got 64-bit integer `-2`, expected a non-negative integer"
        );
        assert_eq!(
            plain("invalid type: integer `3`, expected enum PlifOutToml"),
            "got integer `3`, expected a string"
        );
        assert_eq!(
            plain("invalid type: string \"x\", expected struct ModelToml"),
            "got string \"x\", expected an object"
        );
        assert_eq!(plain("invalid type: sequence, expected u8"), {
            "got a list, expected a non-negative integer"
        });
        assert_eq!(
            plain("invalid type: integer `7`, expected string or map"),
            "got integer `7`, expected a string"
        );
        // A name that only starts like a Rust type is left alone.
        assert_eq!(plain("expected u80 things"), "expected u80 things");
        assert_eq!(
            plain("enum Schedule does not have variant constructor bogus for key `train.schedule`"),
            "unknown value `bogus`"
        );
        // serde's own enum message already names what is accepted.
        assert_eq!(
            plain("unknown variant `bogus`, expected `leak` or `v_post`"),
            "unknown variant `bogus`, expected `leak` or `v_post`"
        );
    }
}
