//! What happened, in virtual time: one line per event a person needs to follow a run
//! (virtual ms, actor, event), and the view of one stream's story.

use std::fmt::Write as _;

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// Virtual ms.
    pub at: u64,
    /// Who: `client3`, `gw0`, `replica1`, `engine3`, `world`.
    pub actor: String,
    /// The stream it concerns, if one.
    pub stream: Option<usize>,
    /// What happened.
    pub what: String,
}

/// Every event of a run.
#[derive(Debug, Default, Clone)]
pub struct Timeline {
    /// In order of time.
    pub lines: Vec<Line>,
}

impl Timeline {
    /// Records an event.
    pub fn push(
        &mut self,
        at: u64,
        actor: impl Into<String>,
        stream: Option<usize>,
        what: impl Into<String>,
    ) {
        self.lines.push(Line {
            at,
            actor: actor.into(),
            stream,
            what: what.into(),
        });
    }

    /// The story of `stream`: its own events and the world's (faults, leases), as text.
    pub fn story(&self, stream: usize) -> String {
        let mut out = String::new();
        for l in self
            .lines
            .iter()
            .filter(|l| l.stream.is_none_or(|s| s == stream))
        {
            let _ = writeln!(out, "{:>9} ms  {:<9} {}", l.at, l.actor, l.what);
        }
        out
    }

    /// The events of `stream` alone.
    pub fn story_of(&self, stream: usize) -> String {
        let mut out = String::new();
        for l in self.lines.iter().filter(|l| l.stream == Some(stream)) {
            let _ = writeln!(out, "{:>9} ms  {:<9} {}", l.at, l.actor, l.what);
        }
        out
    }
}
