//! A set of stacks with a value each.

use std::{
    collections::{BTreeMap, HashMap},
    rc::Rc,
};

/// `frames` (root first) as one folded stack, `root;...;leaf`, each
/// frame sanitized for the format: `;` separates frames, so a `;` inside a
/// name (Rust array types, `[u8; 32]`) becomes `:`, and line breaks become
/// spaces. No frame at all is `[empty stack]`.
pub fn fold<S: AsRef<str>>(frames: impl IntoIterator<Item = S>) -> String {
    let mut key = String::new();
    for (i, frame) in frames.into_iter().enumerate() {
        if i > 0 {
            key.push(';');
        }
        let frame = frame.as_ref();
        if frame.bytes().any(|b| matches!(b, b';' | b'\n' | b'\r')) {
            key.extend(frame.chars().map(|c| match c {
                ';' => ':',
                '\n' | '\r' => ' ',
                c => c,
            }));
        } else {
            key.push_str(frame);
        }
    }
    if key.is_empty() {
        key.push_str("[empty stack]");
    }
    key
}

/// Stacks, root frame first, each with a value (samples, nanoseconds, ...).
///
/// Frame names are stored sanitized for the folded format: `;` separates
/// frames, so a `;` inside a name (Rust array types, `[u8; 32]`) becomes
/// `:`, and line breaks become spaces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Folded {
    stacks: BTreeMap<String, u64>,
}

impl Folded {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `value` to the stack made of `frames` (root first).
    pub fn add<S: AsRef<str>>(&mut self, frames: impl IntoIterator<Item = S>, value: u64) {
        self.add_line(fold(frames), value);
    }

    /// Adds `value` to a stack already folded by [`fold`].
    pub fn add_line(&mut self, line: impl AsRef<str> + Into<String>, value: u64) {
        match self.stacks.get_mut(line.as_ref()) {
            Some(v) => *v += value,
            None => {
                let mut key: String = line.into();
                // Kept: no spare capacity (a profile built over an hour
                // holds thousands of keys of a few KiB each).
                key.shrink_to_fit();
                self.stacks.insert(key, value);
            }
        }
    }

    /// Adds every stack of `other` (copying only the keys that are new).
    pub fn merge(&mut self, other: &Folded) {
        for (k, v) in &other.stacks {
            match self.stacks.get_mut(k) {
                Some(total) => *total += v,
                None => {
                    self.stacks.insert(k.clone(), *v);
                }
            }
        }
    }

    /// Sum of all values.
    /// The sum of all counts (saturating: a parsed file's counts may add up
    /// past u64).
    pub fn total(&self) -> u64 {
        self.stacks.values().fold(0u64, |a, &v| a.saturating_add(v))
    }

    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }

    /// Distinct stacks.
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    /// `(stack, value)` pairs, stacks as `root;...;leaf`, in sorted order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> {
        self.stacks.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// Sum of the values of stacks that contain a frame for which `matches`
    /// holds (each stack counted once).
    pub fn total_where(&self, matches: impl Fn(&str) -> bool) -> u64 {
        self.iter()
            .filter(|(stack, _)| stack.split(';').any(&matches))
            .map(|(_, v)| v)
            .fold(0u64, |a, v| a.saturating_add(v))
    }

    /// The folded text: one `stack value` line per stack, sorted.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for (stack, value) in self.iter() {
            out.push_str(stack);
            out.push(' ');
            out.push_str(&value.to_string());
            out.push('\n');
        }
        out
    }

    /// Reads folded text back. Blank lines are ignored; a line without a
    /// trailing count is an error naming the line.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let mut folded = Folded::new();
        let mut total = 0u64;
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            let (stack, value) = line
                .rsplit_once(' ')
                .and_then(|(s, v)| Some((s, v.parse::<u64>().ok()?)))
                .ok_or_else(|| anyhow::anyhow!("line {}: expected `stack count`, got {line:?}", n + 1))?;
            // Every count is at most the running total: one check bounds both.
            total = total.checked_add(value).ok_or_else(|| {
                anyhow::anyhow!("line {}: the counts add up past 2^64: not a profile", n + 1)
            })?;
            *folded.stacks.entry(stack.to_string()).or_default() += value;
        }
        Ok(folded)
    }
}

/// Stacks added up over a long time (an hour of slots): each frame name
/// is kept once and a stack is a list of frame numbers, so memory grows
/// with the distinct frames and stacks, not with the length of their
/// names. A validator's stack is 20-40 frames of long Rust names (1-4 KiB
/// as folded text, about 100-200 bytes here); an hour's [`Folded`] grew
/// `slotprof run` by about 1 MB a minute.
#[derive(Clone, Debug, Default)]
pub struct FoldedSum {
    names: Vec<Rc<str>>,
    ids: HashMap<Rc<str>, u32>,
    stacks: HashMap<Box<[u32]>, u64>,
}

impl FoldedSum {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds every stack of `f`.
    pub fn add(&mut self, f: &Folded) {
        let mut frames = Vec::with_capacity(64);
        for (stack, value) in f.iter() {
            frames.clear();
            for name in stack.split(';') {
                let id = match self.ids.get(name) {
                    Some(&id) => id,
                    None => {
                        let id = self.names.len() as u32;
                        let name: Rc<str> = name.into();
                        self.names.push(name.clone());
                        self.ids.insert(name, id);
                        id
                    }
                };
                frames.push(id);
            }
            match self.stacks.get_mut(frames.as_slice()) {
                Some(total) => *total += value,
                None => {
                    self.stacks.insert(frames.as_slice().into(), value);
                }
            }
        }
    }

    /// The stacks as a [`Folded`] (to render; built whole, then dropped).
    pub fn to_folded(&self) -> Folded {
        let mut stacks = BTreeMap::new();
        for (frames, &value) in &self.stacks {
            let mut key = String::new();
            for (i, &id) in frames.iter().enumerate() {
                if i > 0 {
                    key.push(';');
                }
                key.push_str(&self.names[id as usize]);
            }
            stacks.insert(key, value);
        }
        Folded { stacks }
    }

    /// Distinct stacks.
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_sanitizes_and_roundtrips() {
        let mut f = Folded::new();
        f.add(["main", "<[u8; 32] as Foo>::bar"], 3);
        f.add(["main", "<[u8; 32] as Foo>::bar"], 2);
        f.add(["worker"], 7);
        assert_eq!(f.total(), 12);
        assert_eq!(f.len(), 2);
        let text = f.to_text();
        assert_eq!(text, "main;<[u8: 32] as Foo>::bar 5\nworker 7\n");
        assert_eq!(Folded::parse(&text).unwrap(), f);
        assert_eq!(f.total_where(|fr| fr.contains("::bar")), 5);
    }

    #[test]
    fn parse_rejects_missing_counts() {
        let err = Folded::parse("a;b 1\na;c\n").unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn a_sum_keeps_every_stack_and_value() {
        let mut a = Folded::new();
        a.add(["main", "<[u8; 32] as Foo>::bar"], 3);
        a.add(["worker"], 7);
        let mut b = Folded::new();
        b.add(["main", "<[u8; 32] as Foo>::bar"], 2);
        b.add(["main", "baz"], 1);
        let mut sum = FoldedSum::new();
        sum.add(&a);
        sum.add(&b);
        let mut merged = a.clone();
        merged.merge(&b);
        assert_eq!(sum.to_folded(), merged);
        assert_eq!(sum.len(), 3);
        // Each name once: main, bar, worker, baz.
        assert_eq!(sum.names.len(), 4);
    }
}
