//! One HTTP/1.x request as the webhook receiver reads it: the head parsed and judged before any
//! of the body is read (method, size, content type, signature present, delivery id), so that a
//! request to refuse costs no more than its head.

use crate::core::hook::{MAX_BODY_BYTES, Reason, Refused};

/// The longest head (request line and headers) read; Forgejo's are under 2 KiB.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// The longest `X-Forgejo-Delivery` kept (Forgejo's is a UUID, 36 characters).
pub const MAX_DELIVERY_ID: usize = 64;

/// What the receiver reads of a request's head.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Head {
    pub method: String,
    pub content_length: Option<usize>,
    pub content_type: Option<String>,
    pub transfer_encoding: Option<String>,
    pub signature: Option<String>,
    pub delivery: Option<String>,
    pub event: Option<String>,
    pub event_type: Option<String>,
}

/// Where the head ends in `buf` (the index just past `\r\n\r\n`), once it has arrived.
pub fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

fn malformed(detail: impl Into<String>) -> Refused {
    Refused::new(Reason::Malformed, detail)
}

/// Parses a complete head (up to and including its blank line). Header names are matched
/// without regard to case; a header given twice keeps its last value, except the ones that
/// decide (length, signature, delivery id), which must not be given twice.
pub fn parse_head(head: &[u8]) -> Result<Head, Refused> {
    let text =
        std::str::from_utf8(head).map_err(|_| malformed("the request's head is not UTF-8 text"))?;
    let mut lines = text.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let (Some(method), Some(_), Some(version), None) = (method, target, version, parts.next())
    else {
        return Err(malformed("the first line is not `METHOD TARGET HTTP/1.1`"));
    };
    if !matches!(version, "HTTP/1.1" | "HTTP/1.0") || method.is_empty() {
        return Err(malformed("the first line is not `METHOD TARGET HTTP/1.1`"));
    }
    let mut h = Head {
        method: method.to_string(),
        ..Head::default()
    };
    for line in lines.take_while(|l| !l.is_empty()) {
        let Some((name, value)) = line.split_once(':') else {
            return Err(malformed("a header line without a colon"));
        };
        if name.is_empty() || name.contains(|c: char| c.is_whitespace() || c.is_control()) {
            return Err(malformed("a header name with blanks or control characters"));
        }
        let value = value.trim_matches([' ', '\t']).to_string();
        let name = name.to_ascii_lowercase();
        let once = |slot: &mut Option<String>, value: String| match slot {
            Some(_) => Err(malformed(format!("the header {name} is given twice"))),
            None => {
                *slot = Some(value);
                Ok(())
            }
        };
        match name.as_str() {
            "content-length" => {
                if h.content_length.is_some() {
                    return Err(malformed("the header content-length is given twice"));
                }
                let n = value
                    .parse::<usize>()
                    .ok()
                    .filter(|_| value.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| malformed("Content-Length is not a number"))?;
                h.content_length = Some(n);
            }
            "x-forgejo-signature" => once(&mut h.signature, value)?,
            "x-forgejo-delivery" => once(&mut h.delivery, value)?,
            "content-type" => h.content_type = Some(value),
            "transfer-encoding" => h.transfer_encoding = Some(value),
            "x-forgejo-event" => h.event = Some(value),
            "x-forgejo-event-type" => h.event_type = Some(value),
            _ => {}
        }
    }
    Ok(h)
}

/// What must hold of a head before its body is worth reading; the body's length when it does.
/// In this order: POST, no chunked body, a length, at most [`MAX_BODY_BYTES`], JSON, signed, a
/// delivery id (Forgejo, `services/webhook/default.go` `NewRequest` and
/// `services/webhook/shared/payloader.go` `AddDefaultHeaders`, sends every one of them).
pub fn judge_head(h: &Head) -> Result<usize, Refused> {
    if h.method != "POST" {
        return Err(Refused::new(
            Reason::Method,
            format!(
                "method {} is not POST: set the webhook's HTTP method to POST",
                escape(&h.method)
            ),
        ));
    }
    if h.transfer_encoding.is_some() {
        return Err(malformed(
            "a body with Transfer-Encoding (chunked): a Content-Length is needed",
        ));
    }
    let Some(len) = h.content_length else {
        return Err(malformed("no Content-Length"));
    };
    if len > MAX_BODY_BYTES {
        return Err(Refused::new(
            Reason::TooLarge,
            format!("a body of {len} bytes, more than the {MAX_BODY_BYTES} accepted"),
        ));
    }
    let json = h.content_type.as_deref().is_some_and(|t| {
        t.split(';')
            .next()
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
    });
    if !json {
        return Err(Refused::new(
            Reason::ContentType,
            format!(
                "content type {} is not application/json: set the webhook's POST content type to application/json",
                escape(h.content_type.as_deref().unwrap_or("(none)"))
            ),
        ));
    }
    if h.signature.as_deref().is_none_or(str::is_empty) {
        return Err(Refused::new(
            Reason::Unsigned,
            "no X-Forgejo-Signature: give the webhook a secret (Forgejo signs only with one)",
        ));
    }
    let id = h.delivery.as_deref().unwrap_or_default();
    let id_ok = (1..=MAX_DELIVERY_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !id_ok {
        return Err(malformed(
            "no usable X-Forgejo-Delivery (1 to 64 letters, digits, - or _)",
        ));
    }
    Ok(len)
}

/// A value from the request, safe in a log line and short.
pub fn escape(s: &str) -> String {
    let short: String = s.chars().take(64).collect();
    let more = if s.chars().count() > 64 { "…" } else { "" };
    format!("{:?}{more}", crate::core::escape::escape_controls(&short))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "POST /hook HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n\
                        Content-Length: 12\r\nX-Forgejo-Delivery: 5c1f7b0e-8d3a-4e8e-9d0f-2a6c1b7e9f00\r\n\
                        X-Forgejo-Event: push\r\nX-Forgejo-Event-Type: push\r\n\
                        X-Forgejo-Signature: 00ff\r\n\r\n";

    fn head(text: &str) -> Result<Head, Refused> {
        parse_head(text.as_bytes())
    }

    #[test]
    fn forgejos_head_is_read_and_passes() {
        assert_eq!(head_end(GOOD.as_bytes()), Some(GOOD.len()));
        assert_eq!(head_end(&GOOD.as_bytes()[..GOOD.len() - 1]), None);
        let h = head(GOOD).unwrap();
        assert_eq!(h.method, "POST");
        assert_eq!(h.content_length, Some(12));
        assert_eq!(h.signature.as_deref(), Some("00ff"));
        assert_eq!(h.event_type.as_deref(), Some("push"));
        assert_eq!(judge_head(&h), Ok(12));
        // Header names in any case.
        let h = head(&GOOD.replace("X-Forgejo-Signature", "x-forgejo-SIGNATURE")).unwrap();
        assert_eq!(h.signature.as_deref(), Some("00ff"));
    }

    fn reason(text: &str) -> Reason {
        match head(text).and_then(|h| judge_head(&h)) {
            Ok(_) => panic!("accepted: {text}"),
            Err(r) => r.reason,
        }
    }

    // Mutation caught: the size limit removed from judge_head (a 2 MiB body is read).
    #[test]
    fn each_rule_of_the_head_refuses_with_its_reason() {
        let cases = [
            (GOOD.replace("POST", "GET"), Reason::Method),
            (
                GOOD.replace("Content-Length: 12", "Content-Length: 1048577"),
                Reason::TooLarge,
            ),
            (
                GOOD.replace("Content-Length: 12\r\n", ""),
                Reason::Malformed,
            ),
            (
                GOOD.replace("Content-Length: 12", "Transfer-Encoding: chunked"),
                Reason::Malformed,
            ),
            (
                GOOD.replace("application/json", "application/x-www-form-urlencoded"),
                Reason::ContentType,
            ),
            (
                GOOD.replace("X-Forgejo-Signature: 00ff\r\n", ""),
                Reason::Unsigned,
            ),
            (
                GOOD.replace("X-Forgejo-Signature: 00ff", "X-Forgejo-Signature: "),
                Reason::Unsigned,
            ),
            (
                GOOD.replace("5c1f7b0e-8d3a-4e8e-9d0f-2a6c1b7e9f00", "a b"),
                Reason::Malformed,
            ),
            (
                GOOD.replace("X-Forgejo-Delivery", "X-Gitea-Delivery"),
                Reason::Malformed,
            ),
            (GOOD.replace("HTTP/1.1", "HTTP/2"), Reason::Malformed),
            (GOOD.replace("Host: h", "Host h"), Reason::Malformed),
            (
                GOOD.replace(
                    "Content-Length: 12",
                    "Content-Length: 12\r\nContent-Length: 13",
                ),
                Reason::Malformed,
            ),
            (
                GOOD.replace(
                    "X-Forgejo-Signature: 00ff",
                    "X-Forgejo-Signature: 00ff\r\nX-Forgejo-Signature: 11",
                ),
                Reason::Malformed,
            ),
            (
                GOOD.replace("Content-Length: 12", "Content-Length: +12"),
                Reason::Malformed,
            ),
        ];
        for (text, want) in cases {
            assert_eq!(reason(&text), want, "{text}");
        }
        // Exactly the limit is accepted.
        let at_limit = GOOD.replace("Content-Length: 12", "Content-Length: 1048576");
        assert_eq!(
            head(&at_limit).and_then(|h| judge_head(&h)),
            Ok(MAX_BODY_BYTES)
        );
        assert!(parse_head(b"\xff\xfe POST").is_err());
    }

    #[test]
    fn request_text_in_a_refusal_is_escaped_and_short() {
        let r = judge_head(&Head {
            method: "GET\u{1b}[2J".into(),
            ..Head::default()
        })
        .unwrap_err();
        assert!(r.detail.contains("\\u{1b}"), "{}", r.detail);
        assert!(!escape(&"x".repeat(500)).contains(&"x".repeat(65)));
    }
}
