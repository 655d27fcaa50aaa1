//! A light, allocation-free look into one JSON event: just enough structure to find
//! whether it ends the stream or is progress, without building a value tree.
//!
//! It tracks nesting and strings (escapes included), and reports:
//! - top-level `"type"` equal to a Responses API terminal event (`response.completed`,
//!   `response.failed`, `response.incomplete`), or to a non-progress event name
//!   (`non_progress_events`: heartbeats, the Responses API preamble);
//! - top-level `"done": true` (NDJSON streams such as Ollama's);
//! - when asked ([`look_with`] `content`): a Responses API event (`"type":"response.*"`)
//!   other than a `*.delta` or `*.done` (no content yet), or a Chat/Completions chunk
//!   whose `choices` carry no content (the role-only first chunk, an empty delta, a
//!   usage-only chunk). Content
//!   is anything else: a non-empty `text`; in a `delta` / `message`, any member but `role`
//!   whose value is not `null`, `""`, `[]` or `{}` (`content`, `tool_calls`, reasoning...);
//!   any other choice member that is not `null` (`finish_reason`, `logprobs`...). What
//!   the look does not know is content: a false "no content" could cut a read stream.
//!
//! `finish_reason` is not among them: it never completes a stream (see `scan`). Keys
//! nested deeper (`item.type`, `message.done`, a key's text inside a string...) are never
//! confused with these: only the top level counts.

use memchr::{memchr2, memchr_iter, memmem};
use std::borrow::Cow;

/// Deepest nesting followed; deeper JSON is reported malformed (and ignored).
const MAX_DEPTH: usize = 48;

/// What one event says about completion and progress.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Look {
    /// A Responses API terminal `type`.
    pub terminal_type: bool,
    /// A top-level `type` that is not progress (`non_progress_events`).
    pub idle_type: bool,
    /// Only with `content`: a Chat/Completions chunk whose choices carry no content, or a
    /// Responses API event other than a `*.delta` / `*.done` (`response.created`,
    /// `response.output_item.added`...: no content yet).
    pub no_content: bool,
    /// `"done": true` at the top level.
    pub done: bool,
    /// The text is not a JSON object this look could follow (it is then ignored).
    pub malformed: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Top,
    /// The top level's `choices` array (content look only).
    Choices,
    /// One choice.
    Choice,
    /// A choice's `delta` / `message`.
    Delta,
    /// A container inside a delta member: anything in it is content.
    Inner,
    Other,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum KeyId {
    None,
    Type,
    Done,
    /// Top level `choices`.
    Choices,
    /// A choice's `text`: `""` or `null` is no content.
    Text,
    /// A choice's `delta` / `message`.
    Delta,
    /// A choice's `index`, a delta's `role`: anything.
    Any,
    /// Anything else in a choice or delta (`null`, or in a delta `""`/`[]`/`{}`, is no
    /// content).
    Member,
    Other,
}

#[derive(Clone, Copy)]
struct Frame {
    is_obj: bool,
    role: Role,
    /// In an object: the next token must be a key.
    expect_key: bool,
    /// The current member (or array element) already has its value: only `,` or the
    /// closer may follow (two values in a row are malformed).
    has_value: bool,
    key: KeyId,
}

/// Whether `json` certainly cannot change a stream's completion, so that the full
/// [`look`] can be skipped (`false`: run the look).
///
/// `true` only when, in the raw bytes: there is no `\u` escape of a letter or `_` (the
/// only escapes that can spell a key), the text ends in `}`, every `"done"` is followed by
/// anything but `: true`, and no `"type"` by a Responses API terminal type (or by a string
/// with an escape). A look at such an event could report nothing. The one thing skipped is
/// counting a malformed event that ends in `}`.
///
/// This runs on every data event: one vectorised pass over the quotes (and one over the
/// rare backslashes) instead of a structural walk of the whole event.
pub fn inert(json: &[u8]) -> bool {
    inert_with(json, &crate::scan::DEFAULT_EVENT_WORDS)
}

/// [`inert`] with the event names that matter (terminal first, then the non-progress
/// ones: [`crate::config::Config::event_words`]): also false when a `"type"` may be one.
pub fn inert_with<W: AsRef<[u8]>>(json: &[u8], words: &[W]) -> bool {
    if json.last() != Some(&b'}') {
        return false;
    }
    // A `\u` escape of a letter or `_` could spell a key: leave such events to the full
    // look. Other `\u` escapes (control characters in generated text) cannot.
    let escapes_ok = memchr_iter(b'\\', json).all(|at| {
        json.get(at + 1) != Some(&b'u')
            || json
                .get(at + 2..at + 6)
                .and_then(hex4)
                .is_some_and(|cp| !(0x41..=0x7A).contains(&cp))
    });
    if !escapes_ok {
        return false;
    }
    // The keys that matter: every `"done"` and every `"type"` (each a vectorised substring
    // search, instead of a stop at every quote of the event), wherever it stands.
    let (done, kind) = finders();
    let value_ok = |at: usize, key_len: usize, ok: &dyn Fn(&[u8]) -> bool| {
        let after = json.get(at + key_len..).unwrap_or_default();
        match skip_ws(after).split_first() {
            Some((b':', value)) => ok(skip_ws(value)),
            // The same text as a plain string (not a key): stay on the safe side.
            _ => false,
        }
    };
    // Each predicate mirrors what `walk` does with that key's value.
    let done_ok = |v: &[u8]| literal(v) != b"true";
    let type_ok = |v: &[u8]| {
        // The look compares the decoded string: any escape in it goes to the look.
        if v.first() != Some(&b'"') {
            return true;
        }
        match scan_string(v, 1) {
            Some((raw, _)) => !raw.contains(&b'\\') && !words.iter().any(|w| w.as_ref() == raw),
            None => false,
        }
    };
    done.find_iter(json)
        .all(|at| value_ok(at, DONE_KEY.len(), &done_ok))
        && kind
            .find_iter(json)
            .all(|at| value_ok(at, TYPE_KEY.len(), &type_ok))
}

/// The two keys [`inert`] looks for, quotes included.
const DONE_KEY: &[u8] = b"\"done\"";
const TYPE_KEY: &[u8] = b"\"type\"";

/// The substring searchers of [`inert`], built once per VM.
fn finders() -> &'static (memmem::Finder<'static>, memmem::Finder<'static>) {
    static F: std::sync::OnceLock<(memmem::Finder<'static>, memmem::Finder<'static>)> =
        std::sync::OnceLock::new();
    F.get_or_init(|| (memmem::Finder::new(DONE_KEY), memmem::Finder::new(TYPE_KEY)))
}

/// `v` without the JSON whitespace `walk` skips.
fn skip_ws(v: &[u8]) -> &[u8] {
    let n = v
        .iter()
        .take_while(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
        .count();
    v.get(n..).unwrap_or_default()
}

/// The literal (number, `true`, `null`...) at the start of `v`, as `walk` reads it.
fn literal(v: &[u8]) -> &[u8] {
    scan_literal(v, 0).0
}

/// A string's content with its escapes decoded (borrowed when it has none, which is the
/// case for every key and value a server writes in practice). An invalid escape decodes
/// to nothing that matches.
fn decoded(raw: &[u8]) -> Cow<'_, [u8]> {
    if memchr::memchr(b'\\', raw).is_none() {
        return Cow::Borrowed(raw);
    }
    Cow::Owned(unescape(raw).unwrap_or_default())
}

fn hex4(h: &[u8]) -> Option<u32> {
    if h.len() != 4 {
        return None;
    }
    h.iter().try_fold(0u32, |acc, c| {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            b'A'..=b'F' => c - b'A' + 10,
            _ => return None,
        };
        Some(acc * 16 + u32::from(d))
    })
}

fn unescape(raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let b = raw[i];
        if b != b'\\' {
            out.push(b);
            i += 1;
            continue;
        }
        let e = *raw.get(i + 1)?;
        i += 2;
        let simple = match e {
            b'"' | b'\\' | b'/' => Some(e),
            b'b' => Some(8),
            b'f' => Some(12),
            b'n' => Some(b'\n'),
            b'r' => Some(b'\r'),
            b't' => Some(b'\t'),
            b'u' => None,
            _ => return None,
        };
        if let Some(c) = simple {
            out.push(c);
            continue;
        }
        let cp = hex4(raw.get(i..i + 4)?)?;
        i += 4;
        let c = if (0xD800..0xDC00).contains(&cp) && raw.get(i..i + 2) == Some(&b"\\u"[..]) {
            match hex4(raw.get(i + 2..i + 6).unwrap_or_default()) {
                Some(lo) if (0xDC00..0xE000).contains(&lo) => {
                    i += 6;
                    char::from_u32(0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00))
                }
                _ => None,
            }
        } else {
            char::from_u32(cp)
        };
        let mut buf = [0u8; 4];
        out.extend_from_slice(c.unwrap_or('\u{FFFD}').encode_utf8(&mut buf).as_bytes());
    }
    Some(out)
}

fn key_id(role: Role, raw: &[u8]) -> KeyId {
    // Only the top level (and, for the content look, choices and deltas) has keys that
    // matter; most keys sit elsewhere (`usage`, inside a delta...), and decoding them
    // would be wasted work.
    match role {
        Role::Top => match decoded(raw).as_ref() {
            b"type" => KeyId::Type,
            b"done" => KeyId::Done,
            b"choices" => KeyId::Choices,
            _ => KeyId::Other,
        },
        Role::Choice => match decoded(raw).as_ref() {
            b"text" => KeyId::Text,
            b"delta" | b"message" => KeyId::Delta,
            b"index" => KeyId::Any,
            _ => KeyId::Member,
        },
        Role::Delta => match decoded(raw).as_ref() {
            b"role" => KeyId::Any,
            _ => KeyId::Member,
        },
        _ => KeyId::Other,
    }
}

/// The content look's state.
#[derive(Default)]
struct Content {
    /// Asked for.
    on: bool,
    /// The top level has a `choices` array.
    choices: bool,
    /// Content was found.
    found: bool,
    /// The top-level `type` is a Responses API event without content.
    typed_empty: bool,
}

/// Scans a string starting after its opening quote; returns (content, index after the
/// closing quote).
fn scan_string(json: &[u8], mut i: usize) -> Option<(&[u8], usize)> {
    let start = i;
    loop {
        let rest = json.get(i..)?;
        let off = memchr2(b'"', b'\\', rest)?;
        let at = i + off;
        if json[at] == b'"' {
            return Some((&json[start..at], at + 1));
        }
        i = at + 2;
    }
}

fn scan_literal(json: &[u8], i: usize) -> (&[u8], usize) {
    let mut j = i;
    while j < json.len() && !matches!(json[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n') {
        j += 1;
    }
    (&json[i..j], j)
}

/// Looks into `json` (one event's data). Never panics; a malformed or truncated text
/// yields `malformed: true`.
pub fn look(json: &[u8]) -> Look {
    look_with(json, &crate::scan::DEFAULT_EVENT_WORDS, false)
}

/// [`look`] with the event names that matter (terminal first, then the non-progress
/// ones), and with `content`, whether the choices carry content.
pub fn look_with<W: AsRef<[u8]>>(json: &[u8], words: &[W], content: bool) -> Look {
    let mut out = Look::default();
    let mut c = Content {
        on: content,
        ..Content::default()
    };
    match walk(json, words, &mut out, &mut c) {
        Some(()) => out.no_content = c.on && ((c.choices && !c.found) || c.typed_empty),
        None => {
            out = Look {
                malformed: true,
                ..Look::default()
            }
        }
    }
    out
}

/// The role of a container opened as the value of `key` in a frame of `role` (object
/// members) or as an element of an array of `role`; notes content in `c`.
fn opened(role: Role, key: KeyId, is_obj: bool, c: &mut Content) -> Role {
    if !c.on {
        return Role::Other;
    }
    match (role, key) {
        (Role::Top, KeyId::Choices) if !is_obj => {
            c.choices = true;
            Role::Choices
        }
        (Role::Choices, _) if is_obj => Role::Choice,
        (Role::Choice, KeyId::Delta) if is_obj => Role::Delta,
        (Role::Delta, KeyId::Member) => Role::Inner,
        (Role::Choices | Role::Choice | Role::Inner, _) => {
            c.found = true;
            Role::Other
        }
        _ => Role::Other,
    }
}

/// Notes content for a scalar value (`string`: its raw content, else `lit`) of `key` in
/// a frame of `role`.
fn scalar(role: Role, key: KeyId, string: Option<&[u8]>, lit: &[u8], c: &mut Content) {
    if !c.on {
        return;
    }
    let null = string.is_none() && lit == b"null";
    let empty_string = string.is_some_and(<[u8]>::is_empty);
    let content = match (role, key) {
        (Role::Choices, _) | (Role::Inner, _) => true,
        (Role::Choice | Role::Delta, KeyId::Any) => false,
        (Role::Choice, KeyId::Text) | (Role::Delta, KeyId::Member) => !(null || empty_string),
        (Role::Choice, _) => !null,
        _ => false,
    };
    c.found |= content;
}

/// The open objects and arrays, held inline (no allocation per event).
struct Stack {
    frames: [Frame; MAX_DEPTH],
    len: usize,
}

impl Stack {
    fn new() -> Self {
        Stack {
            frames: [Frame {
                is_obj: false,
                role: Role::Other,
                expect_key: false,
                has_value: false,
                key: KeyId::None,
            }; MAX_DEPTH],
            len: 0,
        }
    }

    fn last_mut(&mut self) -> Option<&mut Frame> {
        self.len.checked_sub(1).and_then(|i| self.frames.get_mut(i))
    }

    /// Pushes a frame; returns None when the nesting is deeper than [`MAX_DEPTH`].
    fn push(&mut self, f: Frame) -> Option<()> {
        *self.frames.get_mut(self.len)? = f;
        self.len += 1;
        Some(())
    }

    fn pop(&mut self) -> Option<Frame> {
        self.len = self.len.checked_sub(1)?;
        self.frames.get(self.len).copied()
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }
}

fn walk<W: AsRef<[u8]>>(json: &[u8], words: &[W], out: &mut Look, c: &mut Content) -> Option<()> {
    let mut stack = Stack::new();
    let mut i = 0usize;
    let mut seen_root = false;
    while i < json.len() {
        let b = json[i];
        match b {
            b' ' | b'\t' | b'\r' | b'\n' => {
                i += 1;
                continue;
            }
            _ => {}
        }
        let Some(top) = stack.last_mut() else {
            if seen_root {
                return None; // trailing garbage
            }
            if b != b'{' {
                return None; // only objects carry what we look for
            }
            seen_root = true;
            stack.push(Frame {
                is_obj: true,
                role: Role::Top,
                expect_key: true,
                has_value: false,
                key: KeyId::None,
            })?;
            i += 1;
            continue;
        };
        if top.is_obj && top.expect_key {
            match b {
                b'"' => {
                    let (raw, next) = scan_string(json, i + 1)?;
                    if top.role == Role::Inner {
                        c.found = true;
                    }
                    top.key = key_id(top.role, raw);
                    top.expect_key = false;
                    i = next;
                    // The colon.
                    while i < json.len() && matches!(json[i], b' ' | b'\t' | b'\r' | b'\n') {
                        i += 1;
                    }
                    if json.get(i) != Some(&b':') {
                        return None;
                    }
                    i += 1;
                }
                b'}' => {
                    stack.pop();
                    i += 1;
                }
                // A comma where a key must stand (`{,` or `,,`) is malformed, as in
                // serde_json.
                _ => return None,
            }
            continue;
        }
        // A value, or a separator / closer after one.
        let (key, is_obj, role) = (top.key, top.is_obj, top.role);
        if !matches!(b, b',' | b'}' | b']') {
            if top.has_value {
                return None;
            }
            top.has_value = true;
        }
        match b {
            b',' => {
                top.has_value = false;
                if is_obj {
                    top.expect_key = true;
                    top.key = KeyId::None;
                }
                i += 1;
            }
            b'}' | b']' => {
                stack.pop();
                i += 1;
            }
            b'{' | b'[' => {
                if is_obj {
                    // A container replaces any earlier value of the same key.
                    match key {
                        KeyId::Done => out.done = false,
                        KeyId::Type => {
                            out.terminal_type = false;
                            out.idle_type = false;
                            c.typed_empty = false;
                        }
                        _ => {}
                    }
                }
                let key = if is_obj { key } else { KeyId::None };
                stack.push(Frame {
                    is_obj: b == b'{',
                    role: opened(role, key, b == b'{', c),
                    expect_key: b == b'{',
                    has_value: false,
                    key: KeyId::None,
                })?;
                i += 1;
            }
            b'"' => {
                let (raw, next) = scan_string(json, i + 1)?;
                if is_obj {
                    // The last value of a repeated key wins, as in serde_json.
                    match key {
                        KeyId::Done => out.done = false,
                        KeyId::Type => {
                            let v = decoded(raw);
                            let k = words.iter().position(|w| w.as_ref() == v.as_ref());
                            out.terminal_type = k.is_some_and(|k| k < crate::scan::TERMINAL);
                            out.idle_type = k.is_some_and(|k| k >= crate::scan::TERMINAL);
                            let v = v.as_ref();
                            c.typed_empty = v.starts_with(b"response.")
                                && !(v.ends_with(b".delta") || v.ends_with(b".done"));
                        }
                        _ => {}
                    }
                }
                scalar(
                    role,
                    if is_obj { key } else { KeyId::None },
                    Some(raw),
                    b"",
                    c,
                );
                i = next;
            }
            _ => {
                let (lit, next) = scan_literal(json, i);
                if lit.is_empty() {
                    return None;
                }
                if is_obj {
                    match key {
                        KeyId::Done => out.done = lit == b"true",
                        KeyId::Type => {
                            out.terminal_type = false;
                            out.idle_type = false;
                            c.typed_empty = false;
                        }
                        _ => {}
                    }
                }
                scalar(role, if is_obj { key } else { KeyId::None }, None, lit, c);
                i = next;
            }
        }
    }
    if stack.is_empty() && seen_root {
        Some(())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ignores_nested_and_quoted_lookalikes() {
        // Keys inside nested objects and inside strings are not the top level's.
        let l = look(br#"{"x":{"done":true},"c":"\"done\":true \\","type":"response.created"}"#);
        assert!(!l.done && !l.terminal_type && !l.malformed);
        let l = look(br#"{"item":{"type":"response.completed"}}"#);
        assert!(!l.terminal_type);
    }

    #[test]
    fn responses_api_and_ndjson() {
        assert!(look(br#"{"type":"response.completed","response":{}}"#).terminal_type);
        assert!(look(br#"{"type":"response.failed"}"#).terminal_type);
        assert!(look(br#"{"type":"response.incomplete"}"#).terminal_type);
        assert!(!look(br#"{"type":"response.output_text.delta"}"#).terminal_type);
        assert!(look(br#"{"model":"m","done": true}"#).done);
        assert!(!look(br#"{"model":"m","done":false}"#).done);
        assert!(!look(br#"{"message":{"done":true}}"#).done);
    }

    #[test]
    fn escapes_and_repeated_keys_agree_with_serde() {
        assert!(look(br#"{"d\u006fne":true}"#).done);
        assert!(look(br#"{"type":"response.c\u006fmpleted"}"#).terminal_type);
        assert!(!look(br#"{"type":"response\/completed"}"#).terminal_type);
        assert!(!look(br#"{"done":true,"done":false}"#).done);
        assert!(look(br#"{"done":false,"done":true}"#).done);
        assert!(!look(br#"{"done":true,"done":{"x":1}}"#).done);
        assert!(!look(br#"{"type":"response.completed","type":"x"}"#).terminal_type);
        assert!(!look(br#"{"type":"response.completed","type":null}"#).terminal_type);
        assert_eq!(
            unescape(br#"a\u00e9\ud83d\ude00\n"#).unwrap(),
            "a\u{e9}\u{1F600}\n".as_bytes()
        );
        assert_eq!(unescape(br#"\ud800x"#).unwrap(), "\u{FFFD}x".as_bytes());
        assert_eq!(unescape(br#"\q"#), None);
        assert_eq!(unescape(br#"\u12"#), None);
    }

    #[test]
    fn hex_escapes_are_read_in_either_case() {
        assert!(look(br#"{"d\u006Fne":true}"#).done);
        assert!(look(br#"{"type":"response.c\u006Fmpleted"}"#).terminal_type);
        assert!(!inert(br#"{"d\u006Fne":true}"#));
        assert_eq!(
            unescape(br#"\u00C9\u00c9"#).unwrap(),
            "\u{C9}\u{C9}".as_bytes()
        );
    }

    #[test]
    fn simple_escapes_decode_as_json_says() {
        assert_eq!(
            unescape(br#"\"\\\/\b\f\n\r\t"#).unwrap(),
            b"\"\\/\x08\x0c\n\r\t"
        );
        // A high surrogate without its low half is a replacement character; what
        // follows it still decodes.
        assert_eq!(
            unescape(br#"\ud800\u0041"#).unwrap(),
            "\u{FFFD}A".as_bytes()
        );
        assert_eq!(
            unescape(br#"\ud83d\ude00"#).unwrap(),
            "\u{1F600}".as_bytes()
        );
        // What they decode to is what keys and types are compared as.
        assert!(!look(br#"{"\/done":true,"done\t":true}"#).done);
    }

    #[test]
    fn malformed_inputs() {
        for bad in [
            &b""[..],
            b"[DONE]",
            b"{",
            b"{\"a\"}",
            b"{\"a\":1}}",
            b"{\"a\":\"unterminated",
            b"{\"a\":1} x",
            b"[1,2]",
            b"{\"a\":1 2}",
            b"{\"choices\":[{\"index\":1npe x 3}]}",
            b"{\"a\":[1 {}]}",
            b"{\"a\":\"x\"\"y\"}",
        ] {
            assert!(look(bad).malformed, "{:?}", String::from_utf8_lossy(bad));
        }
        let deep = format!("{{\"a\":{}1{}}}", "[".repeat(100), "]".repeat(100));
        assert!(look(deep.as_bytes()).malformed);
    }

    #[test]
    fn whitespace_may_stand_between_a_key_and_its_colon() {
        assert!(look(br#"{"done" : true}"#).done);
        assert!(look(b"{\"done\"\n\t:true}").done);
        // Cut right after a key (or its whitespace): no colon, malformed.
        for cut in [&b"{\"done\""[..], b"{\"done\" ", b"{\"done\" x:true}"] {
            let l = look(cut);
            assert!(l.malformed && !l.done, "{:?}", String::from_utf8_lossy(cut));
        }
    }

    #[test]
    fn a_stray_comma_where_a_key_must_stand_is_malformed_as_in_serde() {
        for bad in [
            &br#"{,"done":true}"#[..],
            br#"{"a":1,,"done":true}"#,
            br#"{"a":1, ,"type":"response.completed"}"#,
        ] {
            assert!(serde_json::from_slice::<serde_json::Value>(bad).is_err());
            let l = look(bad);
            assert!(
                l.malformed && !l.done && !l.terminal_type,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn a_later_value_of_any_kind_replaces_an_earlier_one_of_the_same_key() {
        // Containers.
        assert!(!look(br#"{"type":"response.completed","type":{}}"#).terminal_type);
        assert!(!look(br#"{"type":"response.failed","type":["x"]}"#).terminal_type);
        assert!(!look(br#"{"done":true,"done":[true]}"#).done);
        assert!(look(br#"{"type":{},"type":"response.completed"}"#).terminal_type);
        // Strings.
        assert!(!look(br#"{"done":true,"done":"true"}"#).done);
        assert!(look(br#"{"done":"true","done":true}"#).done);
    }

    #[test]
    fn an_event_cut_inside_a_literal_is_malformed() {
        // The text ends in the middle of a number or `true`: the literal runs to the end
        // of the text, and the object is never closed.
        for cut in [&b"{\"done\":true"[..], b"{\"a\":12", b"{\"a\":[1,2"] {
            let l = look(cut);
            assert!(l.malformed && !l.done, "{:?}", String::from_utf8_lossy(cut));
        }
    }

    #[test]
    fn inert_events() {
        let chat = include_str!("../../../integration/fixtures/sse/vllm-0.32-chat-usage.sse");
        // Every chunk of a chat stream is inert, the finishing one included: only
        // `[DONE]` completes it.
        for e in chat
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| e.starts_with('{'))
        {
            assert!(inert(e.as_bytes()), "{e}");
        }
        for yes in [
            &br#"{"choices":[{"index":1,"finish_reason":"stop"}]}"#[..],
            br#"{"choices":[{"index" : 0 ,"finish_reason":""}],"done":false,"type":"chunk"}"#,
            br#"{"choices":[],"usage":{"prompt_tokens":3}}"#,
            br#"{"model":"m","done":false}"#,
            br#"{"model":"m","message":{"content":"x"},"done":false}"#,
            br#"{"type":"response.output_text.delta","delta":"x"}"#,
            br#"{"index":01}"#,
        ] {
            assert!(inert(yes), "{}", String::from_utf8_lossy(yes));
        }
        for no in [
            &br#"{"model":"m","done": true}"#[..],
            br#"{"type":"response.completed","response":{}}"#,
            br#"{"type":"response\u002ecompleted","response":{}}"#,
            br#"{"d\u006fne":true}"#,
            br#"{"type":"x\"y"}"#,
            br#"{"a":"done","done"}"#,
            br#"{"choices":[{"index":0}]"#,
        ] {
            assert!(!inert(no), "{}", String::from_utf8_lossy(no));
        }
    }

    #[cfg(not(target_family = "wasm"))]
    mod props {
        use super::super::*;
        use proptest::prelude::*;
        /// A key, sometimes with a letter written as a `\u` escape.
        fn key() -> impl Strategy<Value = String> {
            (
                prop_oneof![
                    Just("index"),
                    Just("finish_reason"),
                    Just("done"),
                    Just("type"),
                    Just("choices"),
                    Just("delta"),
                    Just("x")
                ],
                any::<bool>(),
            )
                .prop_map(|(k, esc)| {
                    if esc {
                        k.replacen('e', "\\u0065", 1)
                    } else {
                        k.to_owned()
                    }
                })
        }

        fn scalar() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("null".to_owned()),
                Just("nullx".to_owned()),
                Just("\"\"".to_owned()),
                Just("\"stop\"".to_owned()),
                Just("0".to_owned()),
                Just("1".to_owned()),
                Just("00".to_owned()),
                Just("0.5".to_owned()),
                Just("true".to_owned()),
                Just("false".to_owned()),
                Just("\"response.completed\"".to_owned()),
                Just("\"response.failed\"".to_owned()),
                Just("\"response\\u002ecompleted\"".to_owned()),
                Just("\"index\"".to_owned()),
                Just("\"\\\"finish_reason\\\":\\\"stop\\\"\"".to_owned()),
            ]
        }

        /// JSON-ish events built from the keys and values that matter, nested, with
        /// varied whitespace (sometimes not valid JSON at all).
        fn event() -> impl Strategy<Value = String> {
            let leaf = scalar();
            let value = leaf.prop_recursive(4, 24, 4, |inner| {
                prop_oneof![
                    proptest::collection::vec(
                        (
                            key(),
                            inner.clone(),
                            prop_oneof![Just(""), Just(" "), Just("\n")]
                        ),
                        0..4
                    )
                    .prop_map(|m| format!(
                        "{{{}}}",
                        m.iter()
                            .map(|(k, v, ws)| format!("\"{k}\"{ws}:{ws}{v}"))
                            .collect::<Vec<_>>()
                            .join(",")
                    )),
                    proptest::collection::vec(inner, 0..3)
                        .prop_map(|v| format!("[{}]", v.join(","))),
                ]
            });
            proptest::collection::vec((key(), value), 0..5).prop_map(|m| {
                format!(
                    "{{{}}}",
                    m.iter()
                        .map(|(k, v)| format!("\"{k}\":{v}"))
                        .collect::<Vec<_>>()
                        .join(",")
                )
            })
        }

        proptest! {
            #[test]
            fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
                let _ = look(&bytes);
                let _ = unescape(&bytes);
            }

            /// An event `inert` lets through has nothing to tell the look (or is
            /// malformed): skipping the look never changes completion.
            #[test]
            fn inert_events_have_nothing_to_say(text in event()) {
                if inert(text.as_bytes()) {
                    let l = look(text.as_bytes());
                    prop_assert!(l.malformed || (!l.terminal_type && !l.done), "{}", text);
                }
            }

            #[test]
            fn inert_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
                if inert(&bytes) {
                    let l = look(&bytes);
                    prop_assert!(l.malformed || (!l.terminal_type && !l.done));
                }
            }

            #[test]
            fn agrees_with_serde_json(done in proptest::option::of(any::<bool>()),
                                      ty in proptest::option::of(prop_oneof![Just("response.completed"), Just("response.failed"), Just("response.incomplete"), Just("response.created"), Just("x")]),
                                      escape in any::<bool>(),
                                      extra in "[a-z]{0,6}") {
                let mut members = vec![format!("\"{extra}\":[1,{{\"done\":true}}]")];
                if let Some(d) = done {
                    members.push(format!("\"done\":{d}"));
                }
                if let Some(t) = ty {
                    let t = if escape { t.replace('o', "\\u006f") } else { t.to_string() };
                    members.push(format!("\"type\":\"{t}\""));
                }
                let text = format!("{{{}}}", members.join(","));
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                let l = look(text.as_bytes());
                prop_assert!(!l.malformed);
                prop_assert_eq!(l.done, v.get("done") == Some(&serde_json::Value::Bool(true)));
                let terminal = matches!(v.get("type").and_then(|t| t.as_str()), Some("response.completed" | "response.failed" | "response.incomplete"));
                prop_assert_eq!(l.terminal_type, terminal, "{}", text);
            }
        }
    }
}
