//! Text from Forgejo and tofu printed safely: one line stays one line, and nothing in it can
//! drive a terminal or forge a log line.

/// Characters that must not reach a log line or a terminal as they are: control characters
/// (C0, DEL, C1: newlines, ESC), the line and paragraph separators, and the bidirectional
/// overrides that make a line read other than it is.
pub fn needs_escape(c: char) -> bool {
    const MARKS: [(char, char); 4] = [
        ('\u{200e}', '\u{200f}'), // left-to-right and right-to-left marks
        ('\u{2028}', '\u{2029}'), // line and paragraph separators
        ('\u{202a}', '\u{202e}'), // bidirectional embeddings and overrides
        ('\u{2066}', '\u{2069}'), // bidirectional isolates
    ];
    c.is_control() || MARKS.iter().any(|&(lo, hi)| (lo..=hi).contains(&c))
}

/// `text` with every character of [`needs_escape`] written as Rust escapes it (`\n`, `\r`,
/// `\t`, `\u{1b}`); everything else as it is.
pub fn escape_controls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if needs_escape(c) => out.extend(c.escape_unicode()),
            c => out.push(c),
        }
    }
    out
}
