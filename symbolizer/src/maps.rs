//! Snapshots of `/proc/PID/maps`.

use std::{io, path::PathBuf};

/// One mapping of a process's address space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// Offset in the mapped file of `start`.
    pub file_offset: u64,
    pub executable: bool,
    /// The file behind the mapping; `None` for anonymous memory and pseudo
    /// mappings such as `[vdso]` and `[heap]`.
    pub path: Option<PathBuf>,
    /// What to call the mapping in a frame: the file's base name, or the
    /// pseudo name (`[vdso]`, `[anon]`).
    pub label: String,
}

/// The memory map of one process, accumulated over its lifetime: a later
/// snapshot wins where mappings overlap, and code mappings that went away
/// are kept, because samples taken while they existed still point into
/// them. Data mappings that went away are not: a validator maps and unmaps
/// account files all the time, and an always-on profiler would keep every
/// one it ever saw.
///
/// Kept sorted by start and free of overlaps, so a lookup is a binary
/// search and a merge is `O(n log n)`: a validator maps and unmaps account
/// files all the time and has tens of thousands of mappings.
#[derive(Clone, Debug, Default)]
pub struct ProcessMaps {
    /// Sorted by start, not overlapping.
    mappings: Vec<Mapping>,
    /// Hash of the text of the newest snapshot: an unchanged map is not
    /// merged again.
    text_hash: u64,
}

impl ProcessMaps {
    /// Reads `/proc/PID/maps` now.
    pub fn read(pid: u32) -> io::Result<Self> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
        Ok(Self::from_text(&text))
    }

    /// A snapshot from the text of a maps file.
    pub fn from_text(text: &str) -> Self {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        text.hash(&mut h);
        let mut mappings = parse(text);
        mappings.sort_by_key(|m| m.start);
        Self {
            mappings,
            text_hash: h.finish(),
        }
    }

    /// Folds a newer snapshot in.
    pub fn merge(&mut self, newer: ProcessMaps) {
        if newer.text_hash == self.text_hash && !self.mappings.is_empty() {
            return;
        }
        let overlaps_newer = |old: &Mapping| {
            // The first newer mapping ending after old's start decides.
            let i = newer.mappings.partition_point(|m| m.end <= old.start);
            newer.mappings.get(i).is_some_and(|m| m.start < old.end)
        };
        let mut merged: Vec<Mapping> = self
            .mappings
            .drain(..)
            .filter(|old| old.executable && !overlaps_newer(old))
            .collect();
        merged.extend(newer.mappings);
        merged.sort_by_key(|m| m.start);
        self.mappings = merged;
        self.text_hash = newer.text_hash;
    }

    /// The mapping that holds `addr`.
    pub fn find(&self, addr: u64) -> Option<&Mapping> {
        let i = self.mappings.partition_point(|m| m.start <= addr);
        self.mappings.get(i.checked_sub(1)?).filter(|m| addr < m.end)
    }

    /// Every mapping, by start address.
    pub fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }
}

/// Parses the text of a `/proc/PID/maps` file; malformed lines are skipped.
pub fn parse(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Mapping> {
    // start-end perms offset dev inode [path, which may contain spaces]
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = fields.next()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    let name = fields.next().unwrap_or("").trim_start();
    let (start, end) = range.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    let file_offset = u64::from_str_radix(offset, 16).ok()?;
    let (path, label) = if name.starts_with('/') {
        let path = name.strip_suffix(" (deleted)").unwrap_or(name);
        let label = path.rsplit('/').next().unwrap_or(path).to_string();
        (Some(PathBuf::from(path)), label)
    } else if name.is_empty() {
        (None, "[anon]".to_string())
    } else {
        (None, name.to_string())
    };
    Some(Mapping {
        start,
        end,
        file_offset,
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        path,
        label,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
55d0c0a00000-55d0c0a2c000 r--p 00000000 fd:01 1312 /usr/bin/my prog
55d0c0a2c000-55d0c0b00000 r-xp 0002c000 fd:01 1312 /usr/bin/my prog
7f00aa000000-7f00aa021000 rw-p 00000000 00:00 0 
7ffd1c1f0000-7ffd1c1f2000 r-xp 00000000 00:00 0                          [vdso]
7f00ab000000-7f00ab100000 r-xp 00010000 fd:01 99 /tmp/lib.so (deleted)
";

    #[test]
    fn parses_paths_with_spaces_pseudo_and_deleted() {
        let maps = parse(SAMPLE);
        assert_eq!(maps.len(), 5);
        // Lookups work on the sorted snapshot whatever the file's order.
        let sorted = ProcessMaps::from_text(SAMPLE);
        assert_eq!(sorted.find(0x7ffd1c1f0001).unwrap().label, "[vdso]");
        assert_eq!(sorted.find(0x55d0c0a2bfff).unwrap().label, "my prog");
        assert!(sorted.find(0x55d0c0b00000).is_none());
        assert_eq!(
            maps[1].path.as_deref(),
            Some(std::path::Path::new("/usr/bin/my prog"))
        );
        assert_eq!(maps[1].file_offset, 0x2c000);
        assert!(maps[1].executable && !maps[0].executable);
        assert_eq!(maps[2].label, "[anon]");
        assert_eq!(maps[3].label, "[vdso]");
        assert_eq!(maps[4].path.as_deref(), Some(std::path::Path::new("/tmp/lib.so")));
    }

    #[test]
    fn merge_keeps_unmapped_regions_and_prefers_newer() {
        let mut maps = ProcessMaps::from_text(SAMPLE);
        maps.merge(ProcessMaps::from_text(
            "7f00ab000000-7f00ab080000 r-xp 00000000 fd:01 7 /tmp/other.so\n",
        ));
        assert_eq!(maps.find(0x7f00ab000010).unwrap().label, "other.so");
        // The old lib.so overlapped and is gone; the program text stays.
        assert_eq!(maps.find(0x55d0c0a2c010).unwrap().label, "my prog");
        assert!(maps.find(0x1000).is_none());
        // Data that went away is not kept (code is: the vDSO above).
        assert!(maps.find(0x7f00aa000010).is_none());
        assert_eq!(maps.find(0x7ffd1c1f0001).unwrap().label, "[vdso]");
    }
}
