//! JSON Schema `pattern` and the checked `format`s, as byte DFAs the matcher steps through.
//!
//! A `pattern` matches anywhere in the string (JSON Schema does not anchor it), so the DFA is
//! built, anchored, from `(?s:.*)(?:PATTERN)(?s:.*)`: the whole string is then one match. Every
//! state from which no match can be reached any more is found when the pattern is compiled, so
//! the matcher refuses a byte as soon as the string cannot match, never later.
//!
//! Regex dialect: JSON Schema's is ECMA-262; this is Rust's `regex` syntax, the same for the
//! usual patterns (classes, repetition, anchors, groups, alternation). `\d` and `\w` are taken as
//! ASCII (as in ECMA-262); look-around and backreferences are refused.
//!
//! Formats checked: `date`, `time`, `date-time` (RFC 3339, years 0001 to 9999 as most date
//! libraries take them; days per month checked, but February 29 passes in every year), `uuid`, `ipv4`, `email` (the usual `local@domain` shape). Other
//! formats stay annotations.

use std::collections::{HashMap, HashSet};

use regex_automata::dfa::dense::{self, DFA};
use regex_automata::dfa::{Automaton, StartKind};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};

/// Most DFA states a pattern may have.
const MAX_STATES: usize = 20_000;

/// A compiled pattern.
#[derive(Clone)]
pub(crate) struct Pattern {
    dfa: DFA<Vec<u32>>,
    start: StateID,
    /// States from which a match can still be reached.
    live: HashSet<StateID>,
}

impl std::fmt::Debug for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pattern({} live states)", self.live.len())
    }
}

/// The regex of a checked `format`, if it is one.
pub(crate) fn format_regex(format: &str) -> Option<&'static str> {
    Some(match format {
        "date" => {
            r"^([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-9]))$"
        }
        "time" => r"^([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$",
        "date-time" => {
            r"^([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-9]))[Tt]([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"
        }
        "uuid" => r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
        "ipv4" => r"^((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])$",
        "email" => {
            r"^[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
        }
        _ => return None,
    })
}

/// `\d`, `\w`, `\D`, `\W` as ECMA-262 reads them (ASCII). Inside a class only the positive
/// forms can be rewritten; a negated one there is refused.
fn ascii_classes(p: &str) -> Result<String, String> {
    let mut out = String::with_capacity(p.len() + 16);
    let mut chars = p.chars();
    let mut in_class = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                let Some(e) = chars.next() else { return Err("the pattern ends with `\\`".into()) };
                match (e, in_class) {
                    ('d', false) => out.push_str("[0-9]"),
                    ('D', false) => out.push_str("[^0-9]"),
                    ('w', false) => out.push_str("[0-9A-Za-z_]"),
                    ('W', false) => out.push_str("[^0-9A-Za-z_]"),
                    ('d', true) => out.push_str("0-9"),
                    ('w', true) => out.push_str("0-9A-Za-z_"),
                    ('D' | 'W', true) => return Err(format!("`\\{e}` inside a character class is not enforced")),
                    _ => {
                        out.push('\\');
                        out.push(e);
                    }
                }
            }
            '[' if !in_class => {
                in_class = true;
                out.push(c);
                // A `]` (or `^]`) right after the opening bracket is a literal.
                let rest = chars.as_str();
                let lead = if rest.starts_with("^]") { 2 } else { usize::from(rest.starts_with(']')) };
                out.push_str(&rest[..lead]);
                chars = rest[lead..].chars();
            }
            ']' if in_class => {
                in_class = false;
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    Ok(out)
}

impl Pattern {
    /// Compile a JSON Schema pattern (matched anywhere in the string).
    pub(crate) fn new(pattern: &str) -> Result<Pattern, String> {
        let p = ascii_classes(pattern)?;
        let full = format!("(?s:.*)(?:{p})(?s:.*)");
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .start_kind(StartKind::Anchored)
                    .match_kind(MatchKind::All)
                    .dfa_size_limit(Some(8 << 20))
                    .determinize_size_limit(Some(8 << 20)),
            )
            .build(&full)
            .map_err(|e| format!("the pattern cannot be enforced: {e}"))?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| format!("the pattern cannot be enforced: {e}"))?;
        // Every reachable state, its successors, and which ones accept at the end.
        let mut index: HashMap<StateID, usize> = HashMap::from([(start, 0)]);
        let mut states = vec![start];
        let mut preds: Vec<Vec<usize>> = vec![vec![]];
        let mut accepting = vec![];
        let mut i = 0;
        while i < states.len() {
            let s = states[i];
            accepting.push(dfa.is_match_state(dfa.next_eoi_state(s)));
            if !dfa.is_dead_state(s) && !dfa.is_quit_state(s) {
                for b in 0..=255u8 {
                    let n = dfa.next_state(s, b);
                    let j = *index.entry(n).or_insert_with(|| {
                        states.push(n);
                        preds.push(vec![]);
                        states.len() - 1
                    });
                    preds[j].push(i);
                }
            }
            if states.len() > MAX_STATES {
                return Err(format!("the pattern needs more than {MAX_STATES} DFA states"));
            }
            i += 1;
        }
        // Live: can reach an accepting state.
        let mut live = vec![false; states.len()];
        let mut todo: Vec<usize> = (0..states.len()).filter(|&i| accepting[i]).collect();
        for &i in &todo {
            live[i] = true;
        }
        while let Some(i) = todo.pop() {
            for &p in &preds[i] {
                if !live[p] {
                    live[p] = true;
                    todo.push(p);
                }
            }
        }
        if !live[0] {
            return Err("no string matches the pattern".into());
        }
        let live = states.iter().zip(&live).filter(|(_, &l)| l).map(|(&s, _)| s).collect();
        Ok(Pattern { dfa, start, live })
    }

    pub(crate) fn start(&self) -> StateID {
        self.start
    }

    /// The state after byte `b` of the string, `None` when no match can follow.
    pub(crate) fn step(&self, s: StateID, b: u8) -> Option<StateID> {
        let n = self.dfa.next_state(s, b);
        self.live.contains(&n).then_some(n)
    }

    /// Whether the string may end here.
    pub(crate) fn accepts(&self, s: StateID) -> bool {
        self.dfa.is_match_state(self.dfa.next_eoi_state(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(p: &Pattern, s: &str) -> bool {
        s.bytes().try_fold(p.start(), |st, b| p.step(st, b)).is_some_and(|st| p.accepts(st))
    }

    #[test]
    fn patterns_match_anywhere_and_die_early() {
        let p = Pattern::new("^[a-z]+$").unwrap();
        assert!(matches(&p, "abc") && !matches(&p, "") && !matches(&p, "ab1"));
        // A byte after which no match is possible is refused at once.
        let s = p.step(p.start(), b'a').unwrap();
        assert!(p.step(s, b'1').is_none() && p.step(p.start(), b'A').is_none());
        let q = Pattern::new(r"\d{3}").unwrap();
        assert!(matches(&q, "ab123cd") && !matches(&q, "12a3") && !matches(&q, "١٢٣"));
        let r = Pattern::new(r"^[\w.-]+@x\.org$").unwrap();
        assert!(matches(&r, "a.b-c@x.org") && !matches(&r, "é@x.org"));
        assert!(Pattern::new("(?=a)").is_err() && Pattern::new(r"(a)\1").is_err() && Pattern::new("[^\\D]").is_err());
        assert!(Pattern::new("a^b").is_err(), "nothing matches");
    }

    #[test]
    fn formats_check_the_shape() {
        for (f, ok, bad) in [
            ("date", "2026-12-06", "2026-13-01"),
            ("date", "2024-02-29", "2026-04-31"),
            ("date", "0001-01-01", "0000-01-01"),
            ("time", "20:30:00.5+01:00", "24:00:00Z"),
            ("date-time", "2026-12-06T20:30:00Z", "2026-12-06 20:30:00"),
            ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000"),
            ("ipv4", "192.168.0.255", "256.1.1.1"),
            ("email", "a.b+c@example.co", "a@b@c"),
        ] {
            let p = Pattern::new(format_regex(f).unwrap()).unwrap();
            assert!(matches(&p, ok) && !matches(&p, bad), "{f}");
        }
        assert!(format_regex("uri").is_none());
    }
}
