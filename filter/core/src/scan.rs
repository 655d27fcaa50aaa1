//! Incremental scanner for streamed response bodies (SSE and NDJSON).
//!
//! Bytes are fed in chunks split anywhere (inside a line ending, a field name, a UTF-8
//! sequence...). The scanner keeps only the current event's data (bounded by
//! `max_event_bytes`) and a few bytes of state; it never holds the body.
//!
//! SSE rules (WHATWG): lines end in LF, CRLF or CR; `:` starts a comment; `field:value`
//! with one optional space after the colon; several `data:` lines join with LF; a blank
//! line dispatches the event; a UTF-8 byte-order mark that opens the stream is skipped.
//! An event with no data line (or only whitespace data) is not progress. NDJSON: every
//! non-blank line is an event.
//!
//! Progress is content, not any event: an event named (SSE `event:`) or typed (JSON
//! top-level `"type"`) as one of `non_progress_events` (heartbeats, the Responses API
//! preamble) is not progress, nor, until the stream's first progress, a Chat/Completions
//! chunk whose choices carry no content (the role-only first chunk: a server may send it
//! before the engine scheduled the request). Everything else is progress, what the
//! scanner cannot read included (an oversized or malformed event): a false "no progress"
//! could cut a stream someone reads.
//!
//! Completion: SSE `data: [DONE]` or a terminal Responses API `event:` name; NDJSON (no
//! event names, no `[DONE]`) a terminal `"type"` or `"done": true`. In SSE a JSON value
//! never completes: such a key in a chat chunk is no promise that the stream is over.

use crate::json;
use memchr::{memchr2, memchr3};
use std::ops::Range;

/// How a response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `text/event-stream`.
    Sse,
    /// `application/x-ndjson`, `application/jsonl`, ...
    Ndjson,
    /// Anything else (JSON, compressed, unknown): tracked by end of stream only.
    Opaque,
}

impl Framing {
    /// Chooses the framing from the response `content-type` and `content-encoding`.
    /// Returns the framing and, for an opaque body that would otherwise be scanned,
    /// the anomaly to count (`compressed`).
    pub fn of(content_type: Option<&[u8]>, content_encoding: Option<&[u8]>) -> (Framing, bool) {
        let ct = content_type.unwrap_or_default();
        let media = ct
            .split(|b| *b == b';')
            .next()
            .unwrap_or_default()
            .trim_ascii();
        let framing = if media.eq_ignore_ascii_case(b"text/event-stream") {
            Framing::Sse
        } else if media.eq_ignore_ascii_case(b"application/x-ndjson")
            || media.eq_ignore_ascii_case(b"application/ndjson")
            || media.eq_ignore_ascii_case(b"application/jsonl")
            || media.eq_ignore_ascii_case(b"application/x-jsonlines")
            || media.eq_ignore_ascii_case(b"application/jsonlines")
        {
            Framing::Ndjson
        } else {
            Framing::Opaque
        };
        let encoded = content_encoding
            .map(|e| {
                let e = e.trim_ascii();
                !e.is_empty() && !e.eq_ignore_ascii_case(b"identity")
            })
            .unwrap_or(false);
        if encoded && framing != Framing::Opaque {
            (Framing::Opaque, true)
        } else {
            (framing, false)
        }
    }
}

/// What happened to one dispatched event (for tests and tracing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event<'a> {
    /// A data event, its data (LF-joined lines), and whether it completed the stream.
    Data(&'a [u8], bool),
    /// A data event that is not progress (a heartbeat, a preamble, a chunk without
    /// content before the first progress).
    Idle(&'a [u8]),
    /// A data event larger than `max_event_bytes`: skipped, still progress.
    Oversized,
}

/// What one `feed` call found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fed {
    /// Data events dispatched (progress).
    pub events: u32,
    /// Of those, skipped for size.
    pub oversized: u32,
    /// Events whose JSON could not be followed.
    pub malformed: u32,
    /// The stream became complete during this call.
    pub completed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Data,
    Event,
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At the start of a line.
    Start,
    /// Reading a field name.
    Name,
    /// Reading a value.
    Value(Field),
    /// Skipping to the end of the line (comment or unknown field).
    Skip,
}

/// The SSE field names the scanner acts on.
const FIELD_NAMES: [&[u8]; 2] = [b"data", b"event"];

/// The event names of the default configuration: the [`TERMINAL`] ones that end a
/// Responses API stream, then the default `non_progress_events`
/// ([`crate::config::DEFAULT_NON_PROGRESS_EVENTS`]).
pub const DEFAULT_EVENT_WORDS: [&[u8]; 10] = [
    b"response.completed",
    b"response.failed",
    b"response.incomplete",
    b"ping",
    b"heartbeat",
    b"keepalive",
    b"keep-alive",
    b"response.created",
    b"response.in_progress",
    b"response.queued",
];

/// The first `TERMINAL` event names end a stream; the rest are not progress.
pub const TERMINAL: usize = 3;

/// A UTF-8 byte-order mark.
const BOM: [u8; 3] = [0xEF, 0xBB, 0xBF];

/// Matches bytes that arrive in pieces (split anywhere across chunks) against a few fixed
/// words, keeping a position and one bit per word still possible: 2 bytes in every tracked
/// stream instead of a copy of the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Words {
    /// Bytes seen (saturating: longer than every word is no match anyway).
    len: u8,
    /// Bit `k`: word `k` still matches what was seen (16 words at most).
    live: u16,
}

impl Words {
    /// Nothing to match (no value seen).
    const NONE: Words = Words { len: 0, live: 0 };
    /// A value starts: every word is possible.
    const START: Words = Words {
        len: 0,
        live: u16::MAX,
    };

    fn push<W: AsRef<[u8]>>(&mut self, words: &[W], bytes: &[u8]) {
        for &b in bytes {
            if self.live == 0 {
                return;
            }
            let at = usize::from(self.len);
            for (k, w) in words.iter().take(16).enumerate() {
                if w.as_ref().get(at) != Some(&b) {
                    self.live &= !(1u16 << k);
                }
            }
            self.len = self.len.saturating_add(1);
        }
    }

    /// The index of the word seen exactly, if one was.
    fn matched<W: AsRef<[u8]>>(self, words: &[W]) -> Option<usize> {
        words
            .iter()
            .take(16)
            .enumerate()
            .find(|(k, w)| {
                self.live & (1u16 << k) != 0 && w.as_ref().len() == usize::from(self.len)
            })
            .map(|(k, _)| k)
    }
}

/// The incremental scanner of one response body.
#[derive(Debug, Clone)]
pub struct Scanner {
    framing: Framing,
    /// `u32`, and field names and event names matched as they arrive ([`Words`]) instead
    /// of copied: one scanner lives in every tracked stream.
    max_event_bytes: u32,
    line: Line,
    /// The previous chunk ended in CR: a leading LF belongs to it.
    skip_lf: bool,
    /// A value's optional leading space is still to be skipped.
    skip_space: bool,
    /// The field name being read, matched against [`FIELD_NAMES`].
    name: Words,
    /// The current event's data when it spans lines or chunks (most events are one line
    /// inside one chunk and are read in place): allocated only while such an event is
    /// open, a pointer otherwise (a boxed `Vec`: one thin pointer, 8 bytes less than a
    /// `Vec` or a boxed slice in every tracked stream).
    #[allow(clippy::box_collection)]
    data: Option<Box<Vec<u8>>>,
    /// The current event has a data line.
    has_data: bool,
    oversized: bool,
    /// The event's `event:` value, matched against the event names (terminal first).
    event_name: Words,
    completed: bool,
    /// Bits 0–1: bytes of a [`BOM`] matched at the start of the stream (3: past the
    /// start); [`PROGRESSED`]: a progress event was dispatched (after it, chunks without
    /// content count). One byte (a scanner lives in every tracked stream).
    start: u8,
}

/// [`Scanner`]`::start`: a progress event was dispatched.
const PROGRESSED: u8 = 4;

impl Scanner {
    /// A scanner for a body of `framing`, bounding events at `max_event_bytes`.
    pub fn new(framing: Framing, max_event_bytes: usize) -> Self {
        Scanner {
            framing,
            max_event_bytes: u32::try_from(max_event_bytes).unwrap_or(u32::MAX),
            line: Line::Start,
            skip_lf: false,
            skip_space: false,
            name: Words::NONE,
            data: None,
            has_data: false,
            oversized: false,
            event_name: Words::NONE,
            completed: false,
            start: 0,
        }
    }

    /// The framing this scanner reads.
    pub fn framing(&self) -> Framing {
        self.framing
    }

    /// Whether the body has said it is complete.
    pub fn completed(&self) -> bool {
        self.completed
    }

    /// Feeds a chunk.
    pub fn feed(&mut self, chunk: &[u8]) -> Fed {
        self.feed_with(chunk, &mut |_| {})
    }

    /// Feeds a chunk, calling `on_event` for each dispatched data event (the default
    /// event names).
    pub fn feed_with(&mut self, chunk: &[u8], on_event: &mut dyn FnMut(Event<'_>)) -> Fed {
        self.feed_in(chunk, &DEFAULT_EVENT_WORDS, on_event)
    }

    /// Feeds a chunk with the configured event names (`words`: the [`TERMINAL`] ones
    /// first, then the non-progress ones; [`crate::config::Config::event_words`]).
    pub fn feed_in<W: AsRef<[u8]>>(
        &mut self,
        chunk: &[u8],
        words: &[W],
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Fed {
        let mut fed = Fed::default();
        match self.framing {
            Framing::Opaque => {}
            Framing::Sse | Framing::Ndjson => self.scan(chunk, words, &mut fed, on_event),
        }
        fed
    }

    /// The body ended: an NDJSON last line without a newline still counts. (An SSE
    /// event not closed by a blank line is discarded, as the SSE spec says.)
    pub fn finish(&mut self, on_event: &mut dyn FnMut(Event<'_>)) -> Fed {
        self.finish_in(&DEFAULT_EVENT_WORDS, on_event)
    }

    /// [`Scanner::finish`] with the configured event names.
    pub fn finish_in<W: AsRef<[u8]>>(
        &mut self,
        words: &[W],
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Fed {
        let mut fed = Fed::default();
        // A line still open: `end_line` makes it an event only in NDJSON.
        if matches!(self.line, Line::Value(_)) {
            self.end_line(&mut fed, words, on_event, &[], &mut None);
        }
        fed
    }

    /// Skips a byte-order mark at the start of the stream (split anywhere); returns where
    /// the chunk's own bytes start.
    fn skip_bom(&mut self, chunk: &[u8]) -> usize {
        let mut i = 0;
        while let Some(&want) = BOM.get(usize::from(self.start & 3)) {
            match chunk.get(i) {
                None => break,
                Some(&b) if b == want => {
                    self.start += 1;
                    i += 1;
                }
                // No mark (what a partial one held is dropped: not UTF-8 anyway).
                Some(_) => self.start |= 3,
            }
        }
        i
    }

    fn scan<W: AsRef<[u8]>>(
        &mut self,
        chunk: &[u8],
        words: &[W],
        fed: &mut Fed,
        on_event: &mut dyn FnMut(Event<'_>),
    ) {
        let mut i = self.skip_bom(chunk);
        let len = chunk.len();
        // The current event's data when it is one line wholly inside this chunk (the
        // usual case): kept as a range of the chunk, copied into `self.data` only if the
        // event goes on past it (another data line, or the end of the chunk).
        let mut pending: Option<Range<usize>> = None;
        while i < len {
            if self.skip_lf {
                self.skip_lf = false;
                if chunk[i] == b'\n' {
                    i += 1;
                    continue;
                }
            }
            match self.line {
                Line::Start => {
                    let b = chunk[i];
                    if b == b'\n' || b == b'\r' {
                        // A blank line. (The LF of its CRLF needs no skip: it reads as a
                        // second blank line, which has nothing to dispatch.)
                        i += 1;
                        self.blank_line(fed, words, on_event, chunk, &mut pending);
                        continue;
                    }
                    if self.framing == Framing::Ndjson {
                        self.line = Line::Value(Field::Data);
                        self.materialize(chunk, &mut pending);
                        self.start_data_value();
                        continue;
                    }
                    if b == b':' {
                        // A comment: skipped from its colon (no line end) to the line's end.
                        self.line = Line::Skip;
                        continue;
                    }
                    self.line = Line::Name;
                    self.name = Words::START;
                }
                Line::Name => {
                    let rest = &chunk[i..];
                    let found = memchr3(b':', b'\n', b'\r', rest);
                    let end = found.unwrap_or(rest.len());
                    self.push_name(&rest[..end]);
                    match found {
                        None => i = len,
                        Some(off) => {
                            let delim = rest[off];
                            i += off + 1;
                            let field = self.field_kind();
                            if field == Field::Data {
                                self.materialize(chunk, &mut pending);
                            }
                            if delim == b':' {
                                self.line = Line::Value(field);
                                self.skip_space = true;
                                self.start_value(field);
                            } else {
                                // A field with no colon: the whole line is the name and
                                // the value is empty.
                                self.skip_lf = delim == b'\r';
                                self.start_value(field);
                                self.line = Line::Value(field);
                                self.end_line(fed, words, on_event, chunk, &mut pending);
                            }
                        }
                    }
                }
                Line::Value(field) => {
                    if self.skip_space {
                        self.skip_space = false;
                        if chunk[i] == b' ' {
                            i += 1;
                            continue;
                        }
                    }
                    let rest = &chunk[i..];
                    let found = memchr2(b'\n', b'\r', rest);
                    let end = found.unwrap_or(rest.len());
                    // The line's data can stay in the chunk when it is all the event has
                    // so far. (A second SSE data line finds the joining LF in `data`; an
                    // event already oversized ignores its data whichever way it comes.)
                    let whole_line_here = found.is_some()
                        && field == Field::Data
                        && self.data().is_empty()
                        && pending.is_none()
                        && end <= self.max_event_bytes as usize;
                    if whole_line_here {
                        pending = Some(i..i + end);
                    } else {
                        self.push_value(field, words, &rest[..end]);
                    }
                    match found {
                        None => i = len,
                        Some(off) => {
                            self.skip_lf = rest[off] == b'\r';
                            i += off + 1;
                            self.end_line(fed, words, on_event, chunk, &mut pending);
                        }
                    }
                }
                Line::Skip => {
                    let rest = &chunk[i..];
                    match memchr2(b'\n', b'\r', rest) {
                        None => i = len,
                        Some(off) => {
                            self.skip_lf = rest[off] == b'\r';
                            i += off + 1;
                            self.line = Line::Start;
                        }
                    }
                }
            }
        }
        // The event goes on in the next chunk: keep its data.
        self.materialize(chunk, &mut pending);
    }

    /// Copies a pending in-chunk data line into `self.data`.
    fn materialize(&mut self, chunk: &[u8], pending: &mut Option<Range<usize>>) {
        if let Some(r) = pending.take() {
            if let Some(bytes) = chunk.get(r) {
                self.push_data(bytes);
            }
        }
    }

    fn push_name(&mut self, bytes: &[u8]) {
        self.name.push(&FIELD_NAMES, bytes);
    }

    fn field_kind(&self) -> Field {
        match self.name.matched(&FIELD_NAMES) {
            Some(0) => Field::Data,
            Some(_) => Field::Event,
            None => Field::Other,
        }
    }

    fn start_value(&mut self, field: Field) {
        match field {
            Field::Data => self.start_data_value(),
            Field::Event => self.event_name = Words::START,
            Field::Other => {}
        }
    }

    fn start_data_value(&mut self) {
        if self.has_data && self.framing == Framing::Sse {
            self.push_data(b"\n");
        }
        self.has_data = true;
    }

    fn push_data(&mut self, bytes: &[u8]) {
        if self.oversized {
            return;
        }
        if self.data().len() + bytes.len() > self.max_event_bytes as usize {
            self.oversized = true;
            self.data = None;
            return;
        }
        self.data
            .get_or_insert_with(Box::default)
            .extend_from_slice(bytes);
    }

    fn push_value<W: AsRef<[u8]>>(&mut self, field: Field, words: &[W], bytes: &[u8]) {
        match field {
            Field::Data => self.push_data(bytes),
            Field::Event => self.event_name.push(words, bytes),
            Field::Other => {}
        }
    }

    fn end_line<W: AsRef<[u8]>>(
        &mut self,
        fed: &mut Fed,
        words: &[W],
        on_event: &mut dyn FnMut(Event<'_>),
        chunk: &[u8],
        pending: &mut Option<Range<usize>>,
    ) {
        self.line = Line::Start;
        if self.framing == Framing::Ndjson {
            // Every line is its own event.
            let in_chunk = pending.take().and_then(|r| chunk.get(r));
            self.dispatch(fed, words, on_event, in_chunk);
        }
    }

    fn blank_line<W: AsRef<[u8]>>(
        &mut self,
        fed: &mut Fed,
        words: &[W],
        on_event: &mut dyn FnMut(Event<'_>),
        chunk: &[u8],
        pending: &mut Option<Range<usize>>,
    ) {
        if self.framing == Framing::Sse {
            let in_chunk = pending.take().and_then(|r| chunk.get(r));
            self.dispatch(fed, words, on_event, in_chunk);
        }
    }

    /// Ends an event. Its data is `in_chunk` when it never left the chunk, else
    /// `self.data`.
    fn dispatch<W: AsRef<[u8]>>(
        &mut self,
        fed: &mut Fed,
        words: &[W],
        on_event: &mut dyn FnMut(Event<'_>),
        in_chunk: Option<&[u8]>,
    ) {
        let had_data = self.has_data;
        let oversized = self.oversized;
        let named = self.event_name.matched(words);
        self.has_data = false;
        self.oversized = false;
        self.event_name = Words::NONE;
        if !had_data {
            return;
        }
        if oversized {
            // Unread: progress (a false "no progress" could cut a read stream).
            fed.events += 1;
            fed.oversized += 1;
            self.start |= PROGRESSED;
            on_event(Event::Oversized);
            self.reset_data();
            return;
        }
        let data = in_chunk.unwrap_or(self.data.as_deref().map_or(&[], Vec::as_slice));
        let data = data.trim_ascii();
        if data.is_empty() {
            self.reset_data();
            return;
        }
        let mut progress = named.is_none_or(|k| k < TERMINAL);
        let mut completes = false;
        if !self.completed {
            let ndjson = self.framing == Framing::Ndjson;
            let done = if data == b"[DONE]" || named.is_some_and(|k| k < TERMINAL) {
                true
            } else if data.first() == Some(&b'{') {
                // Before the first progress, whether the choices carry content matters.
                let content = progress && self.start & PROGRESSED == 0;
                if !content && json::inert_with(data, words) {
                    // The common case: a content chunk that cannot complete anything and
                    // is not typed as a non-progress event. No full look.
                    false
                } else {
                    let look = json::look_with(data, words, content);
                    if look.malformed {
                        fed.malformed += 1;
                        false
                    } else {
                        progress &= !look.idle_type && !look.no_content;
                        // `finish_reason` alone never completes: only `[DONE]`, a
                        // terminal Responses API event, `"done": true` (NDJSON) or the
                        // end of stream (a choice index may start after another
                        // finished).
                        ndjson && (look.terminal_type || look.done)
                    }
                }
            } else {
                false
            };
            if done {
                self.completed = true;
                fed.completed = true;
                completes = true;
                progress = true;
            }
        }
        if progress {
            fed.events += 1;
            self.start |= PROGRESSED;
            on_event(Event::Data(data, completes));
        } else {
            on_event(Event::Idle(data));
        }
        self.reset_data();
    }

    /// Frees the event buffer: it only holds events split across chunks, and a buffer
    /// kept per idle stream is most of a tracked stream's memory.
    fn reset_data(&mut self) {
        self.data = None;
    }

    /// The current event's data gathered so far in the buffer.
    fn data(&self) -> &[u8] {
        self.data.as_deref().map_or(&[], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAT: &[u8] =
        include_bytes!("../../../integration/fixtures/sse/vllm-0.32-chat-usage.sse");
    const COMPL: &[u8] =
        include_bytes!("../../../integration/fixtures/sse/vllm-0.32-completions.sse");

    /// Events (as owned data, `None` for oversized) and the event index at which the
    /// stream completed.
    pub(crate) fn run(
        framing: Framing,
        max: usize,
        chunks: &[&[u8]],
    ) -> (Vec<Option<Vec<u8>>>, Option<usize>, u32) {
        let mut s = Scanner::new(framing, max);
        let mut events = Vec::new();
        let mut completed_at = None;
        let mut malformed = 0;
        let mut record = |e: Event<'_>| match e {
            Event::Data(d, completes) => {
                events.push(Some(d.to_vec()));
                if completes {
                    assert!(completed_at.is_none(), "completes once");
                    completed_at = Some(events.len());
                }
            }
            Event::Oversized => events.push(None),
            // Dispatched all the same (what is progress: `progress_of`).
            Event::Idle(d) => events.push(Some(d.to_vec())),
        };
        for c in chunks {
            let fed = s.feed_with(c, &mut record);
            malformed += fed.malformed;
        }
        let fed = s.finish(&mut record);
        malformed += fed.malformed;
        (events, completed_at, malformed)
    }

    fn whole(framing: Framing, body: &[u8]) -> (Vec<Option<Vec<u8>>>, Option<usize>, u32) {
        run(framing, 65536, &[body])
    }

    #[test]
    fn fixtures_complete_at_the_right_event() {
        let (ev, done, bad) = whole(Framing::Sse, CHAT);
        // role chunk + 12 content chunks... then usage, [DONE].
        assert_eq!(ev.last().unwrap().as_deref(), Some(&b"[DONE]"[..]));
        // Completion comes with [DONE], not with the finish_reason chunk.
        assert_eq!(done, Some(ev.len()));
        assert_eq!(bad, 0);
        let (ev, done, bad) = whole(Framing::Sse, COMPL);
        assert!(done.is_some());
        assert!(done.unwrap() <= ev.len());
        assert_eq!(bad, 0);
    }

    #[test]
    fn fixtures_split_at_every_byte() {
        for body in [CHAT, COMPL] {
            let reference = whole(Framing::Sse, body);
            for cut in 0..=body.len() {
                assert_eq!(
                    run(Framing::Sse, 65536, &[&body[..cut], &body[cut..]]),
                    reference,
                    "cut at {cut}"
                );
            }
            // And one byte at a time.
            let bytes: Vec<&[u8]> = body.chunks(1).collect();
            assert_eq!(run(Framing::Sse, 65536, &bytes), reference);
        }
    }

    #[test]
    fn line_endings_are_equivalent() {
        let lf = b"data: {\"a\":1}\n\n: ka\n\ndata: x\ndata: y\n\ndata: [DONE]\n\n".to_vec();
        let crlf: Vec<u8> = String::from_utf8(lf.clone())
            .unwrap()
            .replace('\n', "\r\n")
            .into_bytes();
        let cr: Vec<u8> = String::from_utf8(lf.clone())
            .unwrap()
            .replace('\n', "\r")
            .into_bytes();
        let a = whole(Framing::Sse, &lf);
        assert_eq!(a.0.len(), 3);
        assert_eq!(a.0[1].as_deref(), Some(&b"x\ny"[..]));
        assert_eq!(a.1, Some(3));
        assert_eq!(whole(Framing::Sse, &crlf), a);
        assert_eq!(whole(Framing::Sse, &cr), a);
        // CRLF split between CR and LF is one line ending, not two.
        let parts: Vec<&[u8]> = vec![b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n"];
        let (ev, _, _) = run(Framing::Sse, 1024, &parts);
        assert_eq!(ev, vec![Some(b"a".to_vec()), Some(b"b".to_vec())]);
    }

    #[test]
    fn a_comment_or_a_field_without_colon_ends_its_line_like_any_other() {
        for body in [
            &b"data: x\n: comment\n\ndata: y\n\n"[..],
            b"data: x\nevent\n\ndata: y\n\n",
            b"data: x\r\n: comment\r\n\r\ndata: y\r\n\r\n",
            b"data: x\r\nevent\r\n\r\ndata: y\r\n\r\n",
            b"data: x\r: comment\r\rdata: y\r\r",
            b"data: x\revent\r\rdata: y\r\r",
        ] {
            let (ev, _, _) = whole(Framing::Sse, body);
            assert_eq!(
                ev,
                vec![Some(b"x".to_vec()), Some(b"y".to_vec())],
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        // A comment inside an event does not end it.
        for body in [
            &b"data: x\n: comment\ndata: y\n\n"[..],
            b"data: x\r\n: comment\r\ndata: y\r\n\r\n",
        ] {
            let (ev, _, _) = whole(Framing::Sse, body);
            assert_eq!(ev, vec![Some(b"x\ny".to_vec())]);
        }
    }

    #[test]
    fn an_event_with_empty_data_is_no_progress_whatever_fields_follow_in_a_later_chunk() {
        for later in [&b"id: 1\n\n"[..], b"event: response.completed\n\n"] {
            let (ev, done, _) = run(Framing::Sse, 1024, &[b"data:\n", later]);
            assert!(ev.is_empty() && done.is_none(), "{:?}", ev);
        }
    }

    #[test]
    fn comments_and_empty_events_are_not_progress() {
        let body =
            b": keep-alive\n\n:\n\nevent: ping\n\ndata:\n\ndata:   \n\nretry: 5\n\nid: 3\n\n";
        let (ev, done, _) = whole(Framing::Sse, body);
        assert!(ev.is_empty());
        assert_eq!(done, None);
    }

    #[test]
    fn field_forms() {
        // No space after the colon, a field without colon, an unknown long field name.
        let body = b"data:{\"x\":1}\n\ndata\n\nverylongfieldname: 1\ndata: z\n\n";
        let (ev, _, _) = whole(Framing::Sse, body);
        assert_eq!(ev, vec![Some(b"{\"x\":1}".to_vec()), Some(b"z".to_vec())]);
        // "data" prefix of a longer field is not data.
        let (ev, _, _) = whole(Framing::Sse, b"dataset: 1\n\n");
        assert!(ev.is_empty());
    }

    #[test]
    fn finish_reason_never_completes_interleaved_choices() {
        // Index 0 finishes before index 1's first delta: nothing completes until [DONE].
        let body = concat!(
            "data: {\"choices\":[{\"index\":0,\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[{\"index\":1,\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"index\":1,\"finish_reason\":\"length\"}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"finish_reason\":\"stop\"},{\"index\":1,\"finish_reason\":\"stop\"}]}\n\n",
        );
        let (ev, done, _) = whole(Framing::Sse, body.as_bytes());
        assert_eq!(ev.len(), 5);
        assert_eq!(done, None);
        let with_done = format!("{body}data: [DONE]\n\n");
        let (ev, done, _) = whole(Framing::Sse, with_done.as_bytes());
        assert_eq!(done, Some(ev.len()));
    }

    #[test]
    fn responses_api_terminal_events() {
        let body = concat!(
            "event: response.created\ndata: {\"type\":\"response.created\"}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\"}\n\n",
        );
        let (ev, done, _) = whole(Framing::Sse, body.as_bytes());
        assert_eq!((ev.len(), done), (3, Some(3)));
        // The event name alone is enough (data that is not JSON).
        let (_, done, _) = whole(Framing::Sse, b"event: response.failed\ndata: x\n\n");
        assert_eq!(done, Some(1));
        let (_, done, _) = whole(Framing::Sse, b"event: response.incomplete\ndata: {}\n\n");
        assert_eq!(done, Some(1));
    }

    #[test]
    fn names_are_matched_exactly_wherever_the_chunks_split() {
        // Field and event names are matched as they arrive, not copied: near misses
        // must not match, wherever the body is cut.
        let cases: [(&[u8], usize, Option<usize>); 6] = [
            (b"event: response.completed\ndata: x\n\n", 1, Some(1)),
            (b"event: response.complete\ndata: x\n\n", 1, None),
            (b"event: response.completedX\ndata: x\n\n", 1, None),
            (
                b"event: response.completed\nevent: other\ndata: x\n\n",
                1,
                None,
            ),
            (
                b"dat: x\n\ndatas: y\n\ndata\n\nevent: response.failed\n\ndata: z\n\n",
                1,
                None,
            ),
            (
                b"data: a\n\nevent:response.incomplete\ndata:b\n\n",
                2,
                Some(2),
            ),
        ];
        for (body, events, done) in cases {
            let reference = whole(Framing::Sse, body);
            assert_eq!(
                (reference.0.len(), reference.1),
                (events, done),
                "{}",
                String::from_utf8_lossy(body)
            );
            for cut in 0..=body.len() {
                for cut2 in cut..=body.len() {
                    assert_eq!(
                        run(
                            Framing::Sse,
                            65536,
                            &[&body[..cut], &body[cut..cut2], &body[cut2..]]
                        ),
                        reference,
                        "{} cut at {cut}, {cut2}",
                        String::from_utf8_lossy(body)
                    );
                }
            }
        }
    }

    #[test]
    fn oversized_events_are_skipped_counted_and_progress() {
        let big = format!(
            "data: {{\"choices\":[{{\"index\":0,\"finish_reason\":\"stop\",\"t\":\"{}\"}}]}}\n\n",
            "x".repeat(300)
        );
        let body = format!("{big}data: small\n\n");
        let (ev, done, _) = run(Framing::Sse, 256, &[body.as_bytes()]);
        assert_eq!(ev, vec![None, Some(b"small".to_vec())]);
        // The oversized event was not inspected, so it did not complete the stream.
        assert_eq!(done, None);
        let mut s = Scanner::new(Framing::Sse, 256);
        let fed = s.feed(body.as_bytes());
        assert_eq!((fed.events, fed.oversized), (2, 1));
    }

    #[test]
    fn an_event_of_exactly_max_event_bytes_is_kept_one_byte_more_is_oversized() {
        let at_max = "x".repeat(16);
        let over = "x".repeat(17);
        for framing in [Framing::Sse, Framing::Ndjson] {
            let prefix = if framing == Framing::Sse {
                "data: "
            } else {
                ""
            };
            let kept = format!("{prefix}{at_max}\n\n");
            let dropped = format!("{prefix}{over}\n\n");
            for (body, want) in [(&kept, Some(at_max.as_bytes().to_vec())), (&dropped, None)] {
                // Whole in one chunk, and split inside the data.
                let b = body.as_bytes();
                let (ev, _, _) = run(framing, 16, &[b]);
                assert_eq!(ev, vec![want.clone()], "{framing:?} {body:?}");
                let (ev, _, _) = run(
                    framing,
                    16,
                    &[&b[..prefix.len() + 3], &b[prefix.len() + 3..]],
                );
                assert_eq!(ev, vec![want.clone()], "{framing:?} {body:?} split");
            }
        }
        // Two data lines: their joining LF counts.
        let (ev, _, _) = run(Framing::Sse, 16, &[b"data: 1234567\ndata: 12345678\n\n"]);
        assert_eq!(ev, vec![Some(b"1234567\n12345678".to_vec())]);
        let (ev, _, _) = run(Framing::Sse, 16, &[b"data: 1234567\ndata: 123456789\n\n"]);
        assert_eq!(ev, vec![None]);
    }

    #[test]
    fn ndjson_lines() {
        let body = b"{\"model\":\"m\",\"done\":false}\n\n  \n{\"model\":\"m\",\"done\":false}\r\n{\"done\":true}";
        let (ev, done, _) = whole(Framing::Ndjson, body);
        assert_eq!(ev.len(), 3);
        assert_eq!(done, Some(3));
        // Comment-like lines are data in NDJSON (counted, JSON malformed).
        let (ev, _, bad) = whole(Framing::Ndjson, b": x\n");
        assert_eq!((ev.len(), bad), (1, 0));
    }

    #[test]
    fn malformed_json_counts_but_does_not_complete() {
        let (ev, done, bad) = whole(Framing::Sse, b"data: {\"choices\":[\n\n");
        assert_eq!((ev.len(), done, bad), (1, None, 1));
    }

    #[test]
    fn opaque_counts_nothing() {
        let mut s = Scanner::new(Framing::Opaque, 1024);
        assert_eq!(s.feed(b"data: x\n\n"), Fed::default());
        assert!(!s.completed());
    }

    #[test]
    fn every_ndjson_media_type_is_read_line_by_line() {
        for media in [
            &b"application/x-ndjson"[..],
            b"application/ndjson",
            b"application/jsonl",
            b"application/x-jsonlines",
            b"Application/JSONLines; charset=utf-8",
        ] {
            assert_eq!(
                Framing::of(Some(media), None),
                (Framing::Ndjson, false),
                "{}",
                String::from_utf8_lossy(media)
            );
        }
    }

    #[test]
    fn the_scanner_says_once_the_body_completed() {
        let mut s = Scanner::new(Framing::Sse, 1024);
        s.feed(b"data: {\"choices\":[]}\n\n");
        assert!(!s.completed());
        s.feed(b"data: [DONE]\n\n");
        assert!(s.completed());
        s.feed(b"data: x\n\n");
        assert!(s.completed());
    }

    #[test]
    fn an_sse_event_not_closed_by_a_blank_line_is_dropped_at_the_end() {
        let mut s = Scanner::new(Framing::Sse, 1024);
        assert_eq!(s.feed(b"data: [DONE]\n"), Fed::default());
        assert_eq!(s.finish(&mut |_| {}), Fed::default());
        let mut s = Scanner::new(Framing::Sse, 1024);
        assert_eq!(s.feed(b"data: [DO"), Fed::default());
        assert_eq!(s.finish(&mut |_| {}), Fed::default());
        assert!(!s.completed());
    }

    const RESPONSES: &[u8] =
        include_bytes!("../../../integration/fixtures/sse/openai-spec-responses.sse");

    /// Per dispatched event, whether it was progress; and whether the body completed. The
    /// body is fed whole, then split at every byte: both must agree.
    fn progress_with(framing: Framing, words: &[&[u8]], body: &[u8]) -> (Vec<bool>, bool) {
        let feed = |chunks: &mut dyn Iterator<Item = &[u8]>| {
            let mut s = Scanner::new(framing, 65536);
            let mut out = Vec::new();
            let mut events = 0;
            let mut on = |e: Event<'_>| out.push(!matches!(e, Event::Idle(_)));
            for c in chunks {
                events += s.feed_in(c, words, &mut on).events;
            }
            events += s.finish_in(words, &mut on).events;
            assert_eq!(events as usize, out.iter().filter(|p| **p).count());
            (out, s.completed())
        };
        let whole = feed(&mut core::iter::once(body));
        let bytewise = feed(&mut body.chunks(1));
        assert_eq!(whole, bytewise, "split at every byte");
        whole
    }

    fn progress_of(framing: Framing, body: &[u8]) -> (Vec<bool>, bool) {
        progress_with(framing, &DEFAULT_EVENT_WORDS, body)
    }

    /// Issue 27.2: the Responses API preamble (`response.created`, `response.in_progress`,
    /// and the empty item and part announced before the first token) is not progress; the
    /// deltas are. The fixture is the OpenAI specification's event sequence (a real
    /// vLLM's was not recorded for this change).
    #[test]
    fn the_responses_preamble_is_not_progress() {
        let (p, done) = progress_of(Framing::Sse, RESPONSES);
        assert_eq!(
            p,
            [false, false, false, false, true, true, true, true, true, true]
        );
        assert!(done);
        // NDJSON framing of the same events (typed, no event names) agrees.
        let ndjson: Vec<u8> = RESPONSES
            .split(|b| *b == b'\n')
            .filter_map(|l| l.strip_prefix(b"data: "))
            .flat_map(|l| [l, b"\n"].concat())
            .collect();
        let (p, done) = progress_of(Framing::Ndjson, &ndjson);
        assert_eq!(
            p,
            [false, false, false, false, true, true, true, true, true, true]
        );
        assert!(done);
    }

    /// Issue 27.2: the Chat Completions role-only first chunk is not progress; the content
    /// chunks after it are, even one whose delta decoded to "" (the engine produced a
    /// token), and so is the usage-only chunk.
    #[test]
    fn the_role_only_first_chunk_is_not_progress() {
        let (p, done) = progress_of(Framing::Sse, CHAT);
        assert!(!p[0], "the role chunk");
        assert!(p[1..].iter().all(|x| *x), "{p:?}");
        assert!(done);
        let (p, _) = progress_of(Framing::Sse, COMPL);
        assert!(p.iter().all(|x| *x), "a completion's first text is content");
        // An oversized first event is progress (unread): a role-only chunk after it counts.
        let mut s = Scanner::new(Framing::Sse, 256);
        let big = format!("data: {{\"x\":\"{}\"}}\n\n", "a".repeat(300));
        assert_eq!(s.feed(big.as_bytes()).events, 1);
        let role = br#"data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#;
        assert_eq!(s.feed(&[&role[..], b"\n\n"].concat()).events, 1);
        // Before the first progress, a choice without content is not progress, whatever
        // its form; anything the look does not know is.
        let first = |ev: &str| progress_of(Framing::Sse, format!("data: {ev}\n\n").as_bytes()).0;
        for empty in [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant"},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{}},{"index":1,"delta":{"content":""}}]}"#,
            r#"{"choices":[{"index":0,"text":"","finish_reason":null}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":1}}"#,
            r#"{"choices":[{"index":0,"message":{"role":"assistant","content":""}}]}"#,
        ] {
            assert_eq!(first(empty), [false], "{empty}");
        }
        for content in [
            r#"{"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"x"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"","x":1}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"index":0,"text":"t"}]}"#,
            r#"{"choices":[{"index":0,"logprobs":{"content":[]}}]}"#,
            r#"{"choices":[1]}"#,
            r#"{"choices":{"index":0}}"#,
            r#"{"choices":{}}"#,
            r#"{"choices":[[]]}"#,
            r#"{"choices":[{"delta":[]}]}"#,
            r#"{"response":"tok","done":false}"#,
            r#"{"type":"response.output_text.delta","delta":"a"}"#,
            r#"{"type":"response.function_call_arguments.delta","delta":"{"}"#,
            r#"{"type":"error"}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"}"#,
            "not json",
        ] {
            assert_eq!(first(content), [true], "{content}");
        }
    }

    /// Issue 27.3: heartbeats (`event: ping`, `{"type":"ping"}`) are not progress, before
    /// or after the first token; the list is the configuration's.
    #[test]
    fn heartbeats_are_not_progress() {
        let body = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
            event: ping\ndata: {}\n\n\
            data: {\"type\":\"ping\"}\n\n\
            data: {\"type\" : \"heartbeat\",\"t\":1}\n\n\
            event: keep-alive\ndata: 1\n\n\
            data: {\"type\":\"pings\"}\n\n";
        let (p, _) = progress_of(Framing::Sse, body);
        assert_eq!(p, [true, false, false, false, false, true]);
        // Another list: only `beat` is a heartbeat.
        let words: [&[u8]; 4] = [
            b"response.completed",
            b"response.failed",
            b"response.incomplete",
            b"beat",
        ];
        let body = b"data: x\n\nevent: beat\ndata: {}\n\nevent: ping\ndata: {}\n\ndata: {\"type\":\"beat\"}\n\n";
        assert_eq!(
            progress_with(Framing::Sse, &words, body).0,
            [true, false, true, false]
        );
        // NDJSON: typed only.
        let body = b"{\"message\":{\"content\":\"a\"},\"done\":false}\n{\"type\":\"ping\"}\n";
        assert_eq!(progress_of(Framing::Ndjson, body).0, [true, false]);
    }

    /// Issue 27.9: a UTF-8 byte-order mark opening the stream no longer hides its first
    /// field; one later in the stream is data like any other byte.
    #[test]
    fn a_byte_order_mark_at_the_start_is_skipped() {
        let body = b"\xEF\xBB\xBFdata: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(progress_of(Framing::Sse, body), (vec![true, true], true));
        let body = b"\xEF\xBB\xBF{\"response\":\"a\"}\n{\"done\":true}\n";
        assert_eq!(progress_of(Framing::Ndjson, body), (vec![true, true], true));
        // Not at the start: a field named "\u{FEFF}data" is not `data`.
        let body = b"data: x\n\n\xEF\xBB\xBFdata: y\n\n";
        assert_eq!(progress_of(Framing::Sse, body).0, [true]);
        // A partial mark is dropped; what follows it is read.
        let body = b"\xEFdata: x\n\n";
        assert_eq!(progress_of(Framing::Sse, body).0, [true]);
    }

    /// Issue 27.9: in SSE a JSON value (`"done": true`, a terminal `"type"`) does not
    /// complete the stream; `[DONE]` and a terminal `event:` name do. NDJSON, which has
    /// neither, completes on the JSON value.
    #[test]
    fn json_values_complete_ndjson_only() {
        for ev in [
            &b"data: {\"done\":true}\n\n"[..],
            b"data: {\"type\":\"response.completed\"}\n\n",
            b"data: {\"choices\":[],\"type\":\"response.failed\"}\n\n",
        ] {
            assert!(!progress_of(Framing::Sse, ev).1, "{ev:?}");
        }
        assert!(progress_of(Framing::Sse, b"event: response.completed\ndata: {}\n\n").1);
        assert!(progress_of(Framing::Ndjson, b"{\"done\":true}\n").1);
        assert!(progress_of(Framing::Ndjson, b"{\"type\":\"response.incomplete\"}\n").1);
    }

    #[test]
    fn framing_selection() {
        assert_eq!(
            Framing::of(Some(b"text/event-stream; charset=utf-8"), None),
            (Framing::Sse, false)
        );
        assert_eq!(
            Framing::of(Some(b"Text/Event-Stream"), Some(b"identity")),
            (Framing::Sse, false)
        );
        assert_eq!(
            Framing::of(Some(b"text/event-stream"), Some(b"gzip")),
            (Framing::Opaque, true)
        );
        assert_eq!(
            Framing::of(Some(b"application/x-ndjson"), None),
            (Framing::Ndjson, false)
        );
        assert_eq!(
            Framing::of(Some(b"application/json"), Some(b"br")),
            (Framing::Opaque, false)
        );
        assert_eq!(Framing::of(None, None), (Framing::Opaque, false));
    }

    #[cfg(not(target_family = "wasm"))]
    mod props {
        use super::*;
        use proptest::prelude::*;

        fn split_points(len: usize, cuts: &[usize]) -> Vec<usize> {
            let mut p: Vec<usize> = cuts.iter().map(|c| c % (len + 1)).collect();
            p.sort_unstable();
            p
        }

        fn chunks<'a>(body: &'a [u8], points: &[usize]) -> Vec<&'a [u8]> {
            let mut out = Vec::new();
            let mut prev = 0;
            for &p in points {
                out.push(&body[prev..p]);
                prev = p;
            }
            out.push(&body[prev..]);
            out
        }

        fn piece() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("data: {\"choices\":[{\"index\":0,\"finish_reason\":null}]}\n".to_string()),
                Just(
                    "data: {\"choices\":[{\"index\":1,\"finish_reason\":\"stop\"}]}\n".to_string()
                ),
                Just("data: [DONE]\n".to_string()),
                Just(": keep-alive\n".to_string()),
                Just("event: response.completed\n".to_string()),
                Just("\n".to_string()),
                Just("\r\n".to_string()),
                Just("\r".to_string()),
                Just("data:x".to_string()),
                Just("data: {\"done\": true}\n".to_string()),
                "[a-z:{} \"]{0,12}",
            ]
        }

        proptest! {
            #[test]
            fn fixtures_random_chunks(cuts in proptest::collection::vec(any::<usize>(), 0..40), which in 0usize..2) {
                let body = if which == 0 { CHAT } else { COMPL };
                let reference = run(Framing::Sse, 65536, &[body]);
                let pts = split_points(body.len(), &cuts);
                prop_assert_eq!(run(Framing::Sse, 65536, &chunks(body, &pts)), reference);
            }

            #[test]
            fn any_body_any_split(pieces in proptest::collection::vec(piece(), 0..30),
                                  cuts in proptest::collection::vec(any::<usize>(), 0..20),
                                  max in 8usize..200,
                                  ndjson in any::<bool>()) {
                let body: Vec<u8> = pieces.concat().into_bytes();
                let framing = if ndjson { Framing::Ndjson } else { Framing::Sse };
                let reference = run(framing, max, &[&body]);
                let pts = split_points(body.len(), &cuts);
                prop_assert_eq!(run(framing, max, &chunks(&body, &pts)), reference);
            }

            #[test]
            fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..600),
                                           cuts in proptest::collection::vec(any::<usize>(), 0..10)) {
                let pts = split_points(body.len(), &cuts);
                let _ = run(Framing::Sse, 64, &chunks(&body, &pts));
                let _ = run(Framing::Ndjson, 64, &chunks(&body, &pts));
            }
        }
    }
}
