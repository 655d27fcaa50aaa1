//! A light, allocation-free scanner that counts progress in a response body as it passes:
//! SSE data events (an event with at least one `data:` line; comments such as
//! `: keep-alive` are not progress) or NDJSON lines. It works across arbitrary chunk
//! boundaries and never buffers the body.

/// What the body is, from its `content-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `text/event-stream`.
    Sse,
    /// `application/x-ndjson`, `application/jsonl`, `application/json-seq`.
    Ndjson,
    /// Anything else (not scanned).
    Other,
}

impl BodyKind {
    /// Classifies a response by its `content-type` and `content-encoding`: an encoded
    /// body (gzip, br, ...: anything but `identity`) cannot be scanned, so whatever its
    /// type it is [`BodyKind::Other`], whose frames are progress by bytes and which no
    /// parse rule cuts.
    pub fn from_response(ct: Option<&[u8]>, encoding: Option<&[u8]>) -> BodyKind {
        match encoding.map(<[u8]>::trim_ascii) {
            Some(e) if !e.is_empty() && !e.eq_ignore_ascii_case(b"identity") => BodyKind::Other,
            _ => BodyKind::from_content_type(ct),
        }
    }

    /// Classifies a `content-type` value.
    pub fn from_content_type(ct: Option<&[u8]>) -> BodyKind {
        let Some(ct) = ct else {
            return BodyKind::Other;
        };
        let main = ct.split(|b| *b == b';').next().unwrap_or(ct).trim_ascii();
        if main.eq_ignore_ascii_case(b"text/event-stream") {
            BodyKind::Sse
        } else if main.eq_ignore_ascii_case(b"application/x-ndjson")
            || main.eq_ignore_ascii_case(b"application/jsonl")
            || main.eq_ignore_ascii_case(b"application/json-seq")
        {
            BodyKind::Ndjson
        } else {
            BodyKind::Other
        }
    }
}

const DATA: &[u8] = b"data";

/// Scanner state across chunks.
#[derive(Debug, Clone)]
pub struct Scanner {
    kind: BodyKind,
    /// At the start of a line.
    line_start: bool,
    /// Bytes of `data` matched at the start of this line (0..=4), or `None` once the
    /// line is known not to be a data field.
    matched: Option<usize>,
    /// The previous byte was `\r` (so a following `\n` belongs to the same line end).
    after_cr: bool,
    /// The current SSE event has a data line.
    event_has_data: bool,
    /// The current SSE event has any line (a field or a comment).
    event_has_lines: bool,
    /// The current NDJSON line has a non-blank byte.
    line_has_content: bool,
}

impl Scanner {
    /// A scanner for a body of this kind.
    pub fn new(kind: BodyKind) -> Self {
        Scanner {
            kind,
            line_start: true,
            matched: Some(0),
            after_cr: false,
            event_has_data: false,
            event_has_lines: false,
            line_has_content: false,
        }
    }

    /// The body kind.
    pub fn kind(&self) -> BodyKind {
        self.kind
    }

    /// Feeds a chunk; returns how many data events (SSE) or lines (NDJSON) it completed.
    pub fn feed(&mut self, chunk: &[u8]) -> u64 {
        match self.kind {
            BodyKind::Sse => self.feed_sse(chunk),
            BodyKind::Ndjson => self.feed_ndjson(chunk),
            BodyKind::Other => 0,
        }
    }

    fn feed_sse(&mut self, chunk: &[u8]) -> u64 {
        let mut events = 0;
        for &b in chunk {
            if b == b'\n' && self.after_cr {
                self.after_cr = false;
                continue;
            }
            self.after_cr = b == b'\r';
            if b == b'\n' || b == b'\r' {
                if self.line_start {
                    // Empty line: dispatches the event.
                    if self.event_has_data {
                        events += 1;
                    }
                    self.event_has_data = false;
                    self.event_has_lines = false;
                } else {
                    // End of a field line: `data` alone is a data field with an empty value.
                    if self.matched == Some(DATA.len()) {
                        self.event_has_data = true;
                    }
                    self.event_has_lines = true;
                }
                self.line_start = true;
                self.matched = Some(0);
                continue;
            }
            self.line_start = false;
            if let Some(n) = self.matched {
                if n < DATA.len() {
                    self.matched = (DATA[n] == b).then_some(n + 1);
                } else {
                    // After `data`, only `:` makes it the data field name.
                    if b == b':' {
                        self.event_has_data = true;
                    }
                    self.matched = None;
                }
            }
        }
        events
    }

    fn feed_ndjson(&mut self, chunk: &[u8]) -> u64 {
        let mut lines = 0;
        for &b in chunk {
            if b == b'\n' {
                if self.line_has_content {
                    lines += 1;
                }
                self.line_has_content = false;
            } else if !b.is_ascii_whitespace() {
                self.line_has_content = true;
            }
        }
        lines
    }

    /// Bytes to send before a final SSE event so that it is not glued to a partial one:
    /// empty at an event boundary, `"\n"` after a complete line inside an event,
    /// `"\n\n"` in the middle of a line.
    pub fn event_boundary_prefix(&self) -> &'static str {
        if !self.line_start {
            "\n\n"
        } else if self.event_has_lines || self.event_has_data {
            "\n"
        } else {
            ""
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let p = format!(
            "{}/../../integration/fixtures/sse/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
    }

    fn count_all(kind: BodyKind, body: &[u8]) -> u64 {
        Scanner::new(kind).feed(body)
    }

    #[test]
    fn an_encoded_body_is_not_scanned() {
        let sse = Some(&b"text/event-stream"[..]);
        assert_eq!(BodyKind::from_response(sse, None), BodyKind::Sse);
        assert_eq!(
            BodyKind::from_response(sse, Some(b"identity")),
            BodyKind::Sse
        );
        assert_eq!(BodyKind::from_response(sse, Some(b"")), BodyKind::Sse);
        assert_eq!(BodyKind::from_response(sse, Some(b"gzip")), BodyKind::Other);
        assert_eq!(
            BodyKind::from_response(Some(b"application/x-ndjson"), Some(b" br ")),
            BodyKind::Other
        );
    }

    #[test]
    fn content_types() {
        assert_eq!(
            BodyKind::from_content_type(Some(b"text/event-stream; charset=utf-8")),
            BodyKind::Sse
        );
        assert_eq!(
            BodyKind::from_content_type(Some(b"application/x-ndjson")),
            BodyKind::Ndjson
        );
        assert_eq!(
            BodyKind::from_content_type(Some(b"application/json")),
            BodyKind::Other
        );
        assert_eq!(BodyKind::from_content_type(None), BodyKind::Other);
    }

    #[test]
    fn vllm_fixtures_at_every_split() {
        for name in ["vllm-0.32-completions.sse", "vllm-0.32-chat-usage.sse"] {
            let body = fixture(name);
            let expected = body
                .split(|b| *b == b'\n')
                .filter(|l| l.starts_with(b"data:"))
                .count() as u64;
            assert!(expected > 5, "{name}");
            assert_eq!(count_all(BodyKind::Sse, &body), expected, "{name}");
            for cut in 0..=body.len() {
                let mut s = Scanner::new(BodyKind::Sse);
                let n = s.feed(&body[..cut]) + s.feed(&body[cut..]);
                assert_eq!(n, expected, "{name} cut at {cut}");
            }
            // Byte by byte.
            let mut s = Scanner::new(BodyKind::Sse);
            let n: u64 = body.iter().map(|b| s.feed(std::slice::from_ref(b))).sum();
            assert_eq!(n, expected);
        }
    }

    #[test]
    fn comments_and_other_fields_are_not_progress() {
        let body = b": keep-alive\n\n: ping\n\nevent: x\nid: 3\n\nretry: 10\n\ndatax: 1\n\n";
        assert_eq!(count_all(BodyKind::Sse, body), 0);
        let body = b"data: a\ndata: b\n\ndata\n\nevent: e\ndata:{}\n\n";
        assert_eq!(count_all(BodyKind::Sse, body), 3);
        let crlf = b"data: a\r\n\r\n: c\r\n\r\ndata: b\r\r";
        assert_eq!(count_all(BodyKind::Sse, crlf), 2);
        // An event not yet terminated is not counted until its blank line.
        let mut s = Scanner::new(BodyKind::Sse);
        assert_eq!(s.feed(b"data: x\n"), 0);
        assert_eq!(s.feed(b"\n"), 1);
    }

    #[test]
    fn ndjson_lines() {
        assert_eq!(
            count_all(
                BodyKind::Ndjson,
                b"{\"a\":1}\n\n  \n{\"done\":true}\n{\"x\""
            ),
            2
        );
        assert_eq!(count_all(BodyKind::Other, b"data: x\n\n"), 0);
    }

    #[test]
    fn boundary_prefix() {
        let mut s = Scanner::new(BodyKind::Sse);
        assert_eq!(s.event_boundary_prefix(), "");
        s.feed(b"data: {\"a\"");
        assert_eq!(s.event_boundary_prefix(), "\n\n");
        s.feed(b"}\n");
        assert_eq!(s.event_boundary_prefix(), "\n");
        s.feed(b"\n");
        assert_eq!(s.event_boundary_prefix(), "");
    }
}
