//! What an instance received from outside the host's own making: the answers to its
//! HTTP requests and to its `model.generate` calls, recorded in the order the guest asked
//! for them, so that a fork's replay ([`super::fork`]) serves the same answers again. The
//! network and the model would answer otherwise the second time (a server's state moves
//! on; the model trains between steps and samples with the trajectory's seed), and the
//! replayed guest would then not be in its original's state.
//!
//! Every instance has a tape. A fresh one records (if its session can be forked: one of
//! a trajectory's, not a dataset's or a reward's, which live as long as the run); a fork's starts as a copy of its
//! original's, serves those answers while the replay asks for them, each checked against
//! the request that asked for it the first time (the same method, URL, headers and body;
//! the same generate request), and records from where the original stopped. A replay that
//! asks for something else, or for more or fewer answers than were recorded, diverged, and
//! the fork is refused ([`super::fork::ForkError::Answers`]).
//!
//! A response body is recorded as the guest reads it, up to where the guest stopped: a
//! replayed guest stops at the same place, so it never asks for more. Nothing is recorded
//! twice: a body's bytes are held once, shared by a session's forks until one of them is
//! itself forked.

use super::model::Generated;
use bytes::Bytes;
use std::sync::{Arc, Mutex, MutexGuard};
use wasmtime_wasi_http::p2::bindings::http::types::ErrorCode;

/// One instance's record of outside answers.
#[derive(Default)]
pub struct Tape(Mutex<Reel>);

#[derive(Default)]
struct Reel {
    /// Whether answers are kept: only for sessions that can be forked (a dataset's or a
    /// reward's lives as long as the run, and its tape would grow with it).
    recording: bool,
    entries: Vec<Recorded>,
    /// `entries[..replay]` are the original's, served while a fork replays; `served` of
    /// them so far.
    replay: usize,
    served: usize,
    /// The first request of the replay that did not match its record.
    diverged: Option<String>,
}

/// One outside answer, as recorded.
#[derive(Clone)]
pub enum Recorded {
    /// A `model.generate` call: the digest of its request and what it answered.
    Generate {
        request: u64,
        answer: Result<Generated, String>,
    },
    /// An HTTP exchange, filled in as its response and body arrive.
    Http(Arc<Mutex<Exchange>>),
}

/// An HTTP request and what came of it.
#[derive(Clone, Debug, Default)]
pub struct Exchange {
    /// The digest of the request's method, URL and headers.
    pub request: u64,
    /// The digest of the request's body, once it was sent in whole.
    pub body: Option<u64>,
    /// The response's head, or the error the request ended in; `None` while it is on its
    /// way.
    pub answer: Option<Result<ResponseHead, ErrorCode>>,
    /// The guest dropped the response's future before it arrived.
    pub abandoned: bool,
    /// The response body's frames, as far as the guest read them.
    pub frames: Vec<Piece>,
    /// How the body ended: `None` while the guest holds it open.
    pub end: Option<Ending>,
}

/// A response's status line and headers.
#[derive(Clone, Debug)]
pub struct ResponseHead {
    pub status: http::StatusCode,
    pub version: http::Version,
    pub headers: http::HeaderMap,
}

/// A frame of a response body.
#[derive(Clone, Debug)]
pub enum Piece {
    Data(Bytes),
    Trailers(http::HeaderMap),
}

/// How a recorded response body ended.
#[derive(Clone, Debug)]
pub enum Ending {
    /// Read to its end.
    Complete,
    /// Cut off with an error (a cap, the deadline, the connection).
    Failed(ErrorCode),
    /// Dropped by the guest before its end.
    Dropped,
}

/// What answers a request: the outside (record what it says, in `L`), the record (`R`),
/// or neither (the replay asked for something that was not recorded).
pub enum Cue<R, L = ()> {
    Live(L),
    Replay(R),
    Diverged(String),
}

/// A lock that a panic elsewhere does not poison for good: what is recorded stays readable.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Exchange {
    /// The exchange as it stands, for a fork; `Err` while a part of it is still on its
    /// way (a response not yet arrived, a body the guest holds open between calls), which
    /// a copy could not give again.
    fn settled(&self) -> Result<Exchange, String> {
        let open = match (&self.answer, &self.end) {
            _ if self.abandoned => false,
            (None, _) => true,
            (Some(Ok(_)), None) => true,
            _ => false,
        };
        if open {
            return Err("an HTTP request of the session is still open (its response or its body not read to its end)".into());
        }
        Ok(self.clone())
    }
}

impl Tape {
    /// A fresh instance's tape: recording, or keeping nothing.
    pub fn new(recording: bool) -> Tape {
        Tape(Mutex::new(Reel {
            recording,
            ..Reel::default()
        }))
    }

    /// A fork's tape: `entries` (its original's, from [`Tape::snapshot`]) served in order
    /// while the fork replays, then recording.
    pub fn replaying(entries: Vec<Recorded>) -> Tape {
        Tape(Mutex::new(Reel {
            recording: true,
            replay: entries.len(),
            served: 0,
            entries,
            diverged: None,
        }))
    }

    /// A copy of everything recorded, for a fork of this instance; `Err` with the reason
    /// when an HTTP exchange is still open.
    pub fn snapshot(&self) -> Result<Vec<Recorded>, String> {
        let reel = lock(&self.0);
        reel.entries
            .iter()
            .map(|e| match e {
                Recorded::Generate { .. } => Ok(e.clone()),
                Recorded::Http(x) => Ok(Recorded::Http(Arc::new(Mutex::new(lock(x).settled()?)))),
            })
            .collect()
    }

    /// Outside answers recorded so far.
    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.0).entries.len()
    }

    /// The replay is over: `Err` with why if it asked for anything other than was
    /// recorded, or fewer answers. Recording goes on from here.
    pub fn finish_replay(&self) -> Result<(), String> {
        let mut reel = lock(&self.0);
        let (served, replay) = (reel.served, reel.replay);
        reel.replay = reel.served;
        if let Some(why) = reel.diverged.take() {
            return Err(why);
        }
        if served < replay {
            return Err(format!(
                "the replay asked for {served} of the {replay} HTTP and model answers the session received"
            ));
        }
        Ok(())
    }

    /// The next answer to serve while replaying, if it is one `matches` accepts.
    fn next(&self, what: &str, matches: impl FnOnce(&Recorded) -> bool) -> Cue<Recorded> {
        let mut reel = lock(&self.0);
        if reel.served == reel.replay {
            return Cue::Live(());
        }
        let i = reel.served;
        reel.served += 1;
        let entry = reel.entries[i].clone();
        if matches(&entry) {
            return Cue::Replay(entry);
        }
        let why = format!(
            "answer {} of the session was recorded for another request than the replay's {what}",
            i + 1
        );
        reel.diverged.get_or_insert(why.clone());
        Cue::Diverged(why)
    }

    /// Where a `model.generate` call's answer comes from; `request` is its digest.
    pub fn generate(&self, request: u64) -> Cue<Result<Generated, String>> {
        let matches =
            |e: &Recorded| matches!(e, Recorded::Generate { request: r, .. } if *r == request);
        match self.next("model.generate call", matches) {
            Cue::Replay(Recorded::Generate { answer, .. }) => Cue::Replay(answer),
            Cue::Replay(Recorded::Http(_)) => unreachable!("matched a generate entry"),
            Cue::Live(()) => Cue::Live(()),
            Cue::Diverged(why) => Cue::Diverged(why),
        }
    }

    /// Records what a live `model.generate` call answered.
    pub fn record_generate(&self, request: u64, answer: &Result<Generated, String>) {
        let mut reel = lock(&self.0);
        if reel.recording {
            reel.entries.push(Recorded::Generate {
                request,
                answer: answer.clone(),
            });
        }
    }

    /// Where an HTTP request's answer comes from; `request` is the digest of its head.
    /// Live: the exchange to fill in, already on the tape (`None`: nothing is kept).
    pub fn http(&self, request: u64) -> Cue<Arc<Mutex<Exchange>>, Option<Arc<Mutex<Exchange>>>> {
        let matches = |e: &Recorded| matches!(e, Recorded::Http(x) if lock(x).request == request);
        match self.next("HTTP request", matches) {
            Cue::Replay(Recorded::Http(x)) => Cue::Replay(x),
            Cue::Replay(Recorded::Generate { .. }) => unreachable!("matched an HTTP entry"),
            Cue::Diverged(why) => Cue::Diverged(why),
            Cue::Live(()) => {
                let mut reel = lock(&self.0);
                if !reel.recording {
                    return Cue::Live(None);
                }
                let x = Arc::new(Mutex::new(Exchange {
                    request,
                    ..Exchange::default()
                }));
                reel.entries.push(Recorded::Http(x.clone()));
                Cue::Live(Some(x))
            }
        }
    }

    /// A replayed request's body was not the recorded one.
    pub fn diverge(&self, why: String) {
        lock(&self.0).diverged.get_or_insert(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(text: &str) -> Result<Generated, String> {
        Ok(Generated {
            text: text.into(),
            token_ids: vec![1],
            finish_reason: "stop".into(),
            prompt_tokens: 1,
        })
    }

    /// A recorded tape: a model answer, then an HTTP exchange read to its end.
    fn recorded() -> Tape {
        let tape = Tape::new(true);
        assert!(matches!(tape.generate(7), Cue::Live(())));
        tape.record_generate(7, &answer("first"));
        let Cue::Live(Some(x)) = tape.http(9) else {
            panic!("a fresh tape records")
        };
        let mut x = lock(&x);
        x.answer = Some(Ok(ResponseHead {
            status: http::StatusCode::OK,
            version: http::Version::HTTP_11,
            headers: http::HeaderMap::new(),
        }));
        x.frames.push(Piece::Data(Bytes::from_static(b"hello")));
        x.end = Some(Ending::Complete);
        drop(x);
        tape
    }

    #[test]
    fn a_replay_is_served_the_record_in_order_then_records() {
        let fork = Tape::replaying(recorded().snapshot().unwrap());
        assert!(matches!(fork.generate(7), Cue::Replay(Ok(g)) if g.text == "first"));
        let Cue::Replay(x) = fork.http(9) else {
            panic!("the exchange is served from the record")
        };
        assert!(matches!(&lock(&x).frames[..], [Piece::Data(b)] if &b[..] == b"hello"));
        fork.finish_replay().unwrap();
        assert!(matches!(fork.generate(7), Cue::Live(())), "then live");
        fork.record_generate(7, &answer("second"));
        assert_eq!(
            fork.len(),
            3,
            "the fork's tape holds its original's answers and its own"
        );
    }

    #[test]
    fn a_replay_that_asks_for_something_else_diverges() {
        let fork = Tape::replaying(recorded().snapshot().unwrap());
        assert!(
            matches!(fork.http(9), Cue::Diverged(_)),
            "a generate call was recorded first"
        );
        let why = fork.finish_replay().unwrap_err();
        assert!(why.contains("answer 1 of the session was recorded for another request than the replay's HTTP request"), "{why}");

        let fork = Tape::replaying(recorded().snapshot().unwrap());
        assert!(
            matches!(fork.generate(8), Cue::Diverged(_)),
            "another request"
        );
        assert!(fork.finish_replay().is_err());
    }

    #[test]
    fn a_replay_that_asks_for_fewer_answers_diverges() {
        let fork = Tape::replaying(recorded().snapshot().unwrap());
        assert!(matches!(fork.generate(7), Cue::Replay(_)));
        let why = fork.finish_replay().unwrap_err();
        assert!(
            why.contains("asked for 1 of the 2 HTTP and model answers"),
            "{why}"
        );
    }

    #[test]
    fn an_exchange_still_open_cannot_be_copied() {
        let tape = Tape::new(true);
        let Cue::Live(Some(x)) = tape.http(1) else {
            panic!("a fresh tape records")
        };
        assert!(tape.snapshot().is_err(), "no response yet");
        lock(&x).answer = Some(Err(ErrorCode::ConnectionRefused));
        assert!(tape.snapshot().is_ok(), "an error ends it");

        let tape = Tape::new(true);
        let Cue::Live(Some(x)) = tape.http(1) else {
            panic!("a fresh tape records")
        };
        lock(&x).abandoned = true;
        assert!(
            tape.snapshot().is_ok(),
            "a future the guest dropped ends it"
        );
    }

    #[test]
    fn a_tape_that_does_not_record_keeps_nothing() {
        let tape = Tape::new(false);
        tape.record_generate(7, &answer("kept?"));
        assert!(matches!(tape.http(9), Cue::Live(None)));
        assert_eq!(tape.len(), 0);
    }
}
