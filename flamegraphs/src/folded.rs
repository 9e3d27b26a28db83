//! A set of stacks with a value each.

use std::collections::BTreeMap;

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
        let mut key = String::new();
        for (i, frame) in frames.into_iter().enumerate() {
            if i > 0 {
                key.push(';');
            }
            key.extend(frame.as_ref().chars().map(|c| match c {
                ';' => ':',
                '\n' | '\r' => ' ',
                c => c,
            }));
        }
        if key.is_empty() {
            key.push_str("[empty stack]");
        }
        *self.stacks.entry(key).or_default() += value;
    }

    /// Adds every stack of `other`.
    pub fn merge(&mut self, other: &Folded) {
        for (k, v) in &other.stacks {
            *self.stacks.entry(k.clone()).or_default() += v;
        }
    }

    /// Sum of all values.
    pub fn total(&self) -> u64 {
        self.stacks.values().sum()
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
            .sum()
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
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            let (stack, value) = line
                .rsplit_once(' ')
                .and_then(|(s, v)| Some((s, v.parse::<u64>().ok()?)))
                .ok_or_else(|| anyhow::anyhow!("line {}: expected `stack count`, got {line:?}", n + 1))?;
            *folded.stacks.entry(stack.to_string()).or_default() += value;
        }
        Ok(folded)
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
}
