//! pprof profiles (`profile.proto`, gzipped), readable by `go tool pprof`,
//! pprof.me, Grafana Pyroscope and speedscope.

use std::{collections::HashMap, io::Write};

use pprof::protos::{Function, Label, Line, Location, Mapping, Message, ValueType};
pub use pprof::protos::{Profile, Sample};

use crate::Folded;

/// One value column of the profile, e.g. ("samples", "count").
#[derive(Clone, Debug)]
pub struct SampleType {
    pub kind: String,
    pub unit: String,
}

impl SampleType {
    pub fn new(kind: &str, unit: &str) -> Self {
        Self {
            kind: kind.to_string(),
            unit: unit.to_string(),
        }
    }
}

/// Profile-wide facts.
#[derive(Clone, Debug, Default)]
pub struct ProfileMeta {
    /// CLOCK_REALTIME at the start, in ns.
    pub time_nanos: i64,
    pub duration_nanos: i64,
    /// Sampling period, e.g. ("cpu", "nanoseconds") with 1e9 / Hz.
    pub period_type: Option<SampleType>,
    pub period: i64,
    pub comments: Vec<String>,
}

/// Interns strings into the profile's string table (index 0 is "").
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        Self {
            table: vec![String::new()],
            index: HashMap::from([(String::new(), 0)]),
        }
    }

    fn id(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(s.to_string());
        self.index.insert(s.to_string(), i);
        i
    }
}

/// A sample label: a string (`thread_name`) or a number with its unit
/// (`thread_id`, `cpu`, `slot`), as `go tool pprof -tags` lists them and
/// `-tagfocus key=value` selects. Give numbers a unit ("count" for a
/// plain number): Go's decoder drops a numeric label of 0 that has none.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LabelValue {
    Str(String),
    Num(i64, Option<&'static str>),
}

/// A binary mapped in the profiled process: where, from which offset of
/// which file, and its build ID (hex), for symbolization after the fact
/// (`go tool pprof -symbolize`, a backend's symbol server). Whether its
/// functions are named follows from its locations: a mapping none of
/// whose locations has a name is left for such a symbolizer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct MappingInfo {
    pub start: u64,
    pub limit: u64,
    pub offset: u64,
    pub file: String,
    pub build_id: String,
}

/// One function at a location: a location's first line is the innermost
/// (inlined) function, its last the function whose code the address is in.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct FrameLine {
    pub function: String,
    pub file: String,
    pub line: i64,
}

/// A stack frame: the address (0: none, a marker frame) in a mapping
/// (`None`: the kernel, or not known), and the functions there.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Frame {
    pub address: u64,
    pub mapping: Option<u64>,
    pub lines: Vec<FrameLine>,
}

/// Builds a profile sample by sample: strings, functions, mappings and
/// locations are interned (a location is one per mapping and address, or
/// per name for frames without an address).
pub struct Builder {
    strings: Strings,
    sample_type: Vec<ValueType>,
    mappings: Vec<Mapping>,
    mapping_of: HashMap<MappingInfo, u64>,
    functions: Vec<Function>,
    function_of: HashMap<(i64, i64), u64>,
    locations: Vec<Location>,
    location_of: HashMap<Frame, u64>,
    /// Frames known only by name (folded stacks), found without building
    /// a `Frame` for each.
    named: HashMap<String, u64>,
    /// Locations by (mapping, address).
    address_of: HashMap<(u64, u64), u64>,
    /// The samples, encoded as they come (a profile's fields may come in
    /// any order; the tables go after them).
    samples: Spool,
    /// The first error spooling samples (a full temporary directory):
    /// reported by the writer.
    error: Option<std::io::Error>,
}

/// Encoded samples: in memory up to [`Spool::IN_MEMORY`], then in an
/// unnamed temporary file (a whole session of a busy node labels each
/// sample with its slot: hundreds of thousands of samples).
struct Spool {
    buf: Vec<u8>,
    file: Option<std::io::BufWriter<std::fs::File>>,
    count: usize,
    /// Bytes kept in memory before the file is used.
    limit: usize,
}

impl Spool {
    const IN_MEMORY: usize = 4 << 20;

    fn push(&mut self, sample: &Sample) -> std::io::Result<()> {
        // Field 2 of Profile (repeated Sample), length-delimited.
        let len = sample.encoded_len();
        self.buf.push((2 << 3) | 2);
        put_varint(&mut self.buf, len as u64);
        sample.encode(&mut self.buf).map_err(std::io::Error::other)?;
        self.count += 1;
        if self.buf.len() >= self.limit {
            if self.file.is_none() {
                self.file = Some(std::io::BufWriter::new(tempfile::tempfile()?));
            }
            if let Some(f) = &mut self.file {
                f.write_all(&self.buf)?;
            }
            self.buf.clear();
        }
        Ok(())
    }

    /// Writes every sample's encoding to `w`.
    fn drain_into(self, w: &mut impl Write) -> std::io::Result<()> {
        if let Some(f) = self.file {
            use std::io::Seek;
            let mut f = f.into_inner().map_err(|e| e.into_error())?;
            f.seek(std::io::SeekFrom::Start(0))?;
            std::io::copy(&mut f, w)?;
        }
        w.write_all(&self.buf)
    }
}

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

impl Builder {
    pub fn new(sample_types: &[SampleType]) -> Self {
        let mut strings = Strings::new();
        let sample_type = sample_types
            .iter()
            .map(|t| ValueType {
                ty: strings.id(&t.kind),
                unit: strings.id(&t.unit),
            })
            .collect();
        Self {
            strings,
            sample_type,
            mappings: Vec::new(),
            mapping_of: HashMap::new(),
            functions: Vec::new(),
            function_of: HashMap::new(),
            locations: Vec::new(),
            location_of: HashMap::new(),
            named: HashMap::new(),
            address_of: HashMap::new(),
            samples: Spool {
                buf: Vec::new(),
                file: None,
                count: 0,
                limit: Spool::IN_MEMORY,
            },
            error: None,
        }
    }

    /// The id of a mapping (added the first time).
    pub fn mapping(&mut self, m: &MappingInfo) -> u64 {
        if let Some(&id) = self.mapping_of.get(m) {
            return id;
        }
        let id = self.mappings.len() as u64 + 1;
        let (filename, build_id) = (self.strings.id(&m.file), self.strings.id(&m.build_id));
        self.mappings.push(Mapping {
            id,
            memory_start: m.start,
            memory_limit: m.limit,
            file_offset: m.offset,
            filename,
            build_id,
            has_functions: false,
            has_filenames: false,
            has_line_numbers: false,
            has_inline_frames: false,
        });
        self.mapping_of.insert(m.clone(), id);
        id
    }

    fn function(&mut self, name: &str, file: &str) -> u64 {
        // By the strings' ids: the names are kept once, in the table.
        let (n, filename) = (self.strings.id(name), self.strings.id(file));
        if let Some(&id) = self.function_of.get(&(n, filename)) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        self.functions.push(Function {
            id,
            name: n,
            system_name: n,
            filename,
            start_line: 0,
        });
        self.function_of.insert((n, filename), id);
        id
    }

    /// The location of an address in a mapping (added the first time,
    /// with the functions `lines` gives, innermost first; none leaves it
    /// to a symbolizer).
    pub fn address_location(
        &mut self,
        mapping: u64,
        address: u64,
        lines: impl FnOnce() -> Vec<FrameLine>,
    ) -> u64 {
        if let Some(&id) = self.address_of.get(&(mapping, address)) {
            return id;
        }
        let id = self.push_location(&Frame {
            address,
            mapping: Some(mapping),
            lines: lines(),
        });
        self.address_of.insert((mapping, address), id);
        id
    }

    /// The id of a frame's location (added the first time).
    pub fn location(&mut self, frame: &Frame) -> u64 {
        if let Some(&id) = self.location_of.get(frame) {
            return id;
        }
        let id = self.push_location(frame);
        self.location_of.insert(frame.clone(), id);
        id
    }

    /// Adds a location (not interned: the callers' maps find it again).
    fn push_location(&mut self, frame: &Frame) -> u64 {
        if let Some(m) = frame.mapping.filter(|_| !frame.lines.is_empty()) {
            if let Some(m) = self.mappings.get_mut(m as usize - 1) {
                m.has_functions = true;
                m.has_inline_frames = true;
            }
        }
        let line = frame
            .lines
            .iter()
            .map(|l| Line {
                function_id: self.function(&l.function, &l.file),
                line: l.line,
            })
            .collect();
        let id = self.locations.len() as u64 + 1;
        self.locations.push(Location {
            id,
            mapping_id: frame.mapping.unwrap_or(0),
            address: frame.address,
            line,
            is_folded: false,
        });
        id
    }

    /// The location of a frame known only by its name.
    pub fn named_location(&mut self, name: &str) -> u64 {
        if let Some(&id) = self.named.get(name) {
            return id;
        }
        let id = self.push_location(&Frame {
            address: 0,
            mapping: None,
            lines: vec![FrameLine {
                function: name.to_string(),
                ..Default::default()
            }],
        });
        self.named.insert(name.to_string(), id);
        id
    }

    /// Adds a sample: its locations leaf first, a value per sample type,
    /// its labels.
    pub fn sample(&mut self, location_id: Vec<u64>, value: Vec<i64>, labels: &[(&str, LabelValue)]) {
        debug_assert_eq!(value.len(), self.sample_type.len());
        let label = labels
            .iter()
            .map(|(key, v)| {
                let key = self.strings.id(key);
                match v {
                    LabelValue::Str(s) => Label {
                        key,
                        str: self.strings.id(s),
                        ..Default::default()
                    },
                    LabelValue::Num(n, unit) => Label {
                        key,
                        num: *n,
                        num_unit: unit.map_or(0, |u| self.strings.id(u)),
                        ..Default::default()
                    },
                }
            })
            .collect();
        let sample = Sample {
            location_id,
            value,
            label,
        };
        if self.error.is_none() {
            if let Err(e) = self.samples.push(&sample) {
                self.error = Some(e);
            }
        }
    }

    /// Adds a sample of a folded stack (`thread;root;...;leaf`): the
    /// thread is its `thread_name` label (first), then `labels`; a stack
    /// with no frame past its thread keeps one, `[no stack]`, so that tools
    /// which show only stacks count it.
    pub fn folded_sample(&mut self, stack: &str, value: Vec<i64>, labels: &[(&str, LabelValue)]) {
        let location_id = self.folded_locations(stack);
        self.thread_sample(stack, location_id, value, labels);
    }

    /// A sample of the stack `folded` (`thread;root;...;leaf`) at
    /// `location_id`: the thread is its first label, `thread_name`.
    pub fn thread_sample(
        &mut self,
        folded: &str,
        location_id: Vec<u64>,
        value: Vec<i64>,
        labels: &[(&str, LabelValue)],
    ) {
        let thread = folded.split(';').next().unwrap_or_default();
        let mut all = Vec::with_capacity(labels.len() + 1);
        all.push(("thread_name", LabelValue::Str(thread.to_string())));
        all.extend(labels.iter().cloned());
        self.sample(location_id, value, &all);
    }

    /// The named locations of a folded stack's frames past its thread,
    /// leaf first; a stack with no frame keeps one, `[no stack]`, so that
    /// tools which show only stacks count it.
    pub fn folded_locations(&mut self, folded: &str) -> Vec<u64> {
        let mut frames = folded.split(';');
        frames.next();
        let mut location_id: Vec<u64> = frames.rev().map(|f| self.named_location(f)).collect();
        if location_id.is_empty() {
            location_id.push(self.named_location("[no stack]"));
        }
        location_id
    }

    /// Writes the gzipped profile, with `meta`'s time, duration, period
    /// and comments, to `w`.
    pub fn write_gzip(mut self, meta: &ProfileMeta, w: impl Write) -> std::io::Result<()> {
        if let Some(e) = self.error.take() {
            return Err(std::io::Error::new(
                e.kind(),
                format!("the profile's samples could not be kept in a temporary file: {e}"),
            ));
        }
        let period_type = meta.period_type.as_ref().map(|t| ValueType {
            ty: self.strings.id(&t.kind),
            unit: self.strings.id(&t.unit),
        });
        let comment = meta.comments.iter().map(|c| self.strings.id(c)).collect();
        let tables = Profile {
            sample_type: self.sample_type,
            mapping: self.mappings,
            location: self.locations,
            function: self.functions,
            time_nanos: meta.time_nanos,
            duration_nanos: meta.duration_nanos,
            period_type,
            period: meta.period,
            comment,
            string_table: self.strings.table,
            ..Default::default()
        };
        // Level 1, as Go's runtime/pprof writes its profiles: an always-on
        // daemon writes profiles every slot, and the default level was
        // its largest single cost after unwinding (zlib's longest_match).
        let mut gz = flate2::write::GzEncoder::new(w, flate2::Compression::fast());
        // Tables first, then the samples: repeated fields may come in any
        // order and are read as one list.
        gz.write_all(&tables.encode_to_vec())?;
        self.samples.drain_into(&mut gz)?;
        gz.finish()?.flush()
    }

    /// [`Self::write_gzip`] into memory.
    pub fn gzip(self, meta: &ProfileMeta) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        self.write_gzip(meta, &mut out)?;
        Ok(out)
    }

    /// The profile itself (decoded from its encoding: for tests and small
    /// profiles).
    pub fn finish(self, meta: &ProfileMeta) -> std::io::Result<Profile> {
        decode_gzip(&self.gzip(meta)?)
    }
}

/// A part of a profile: per sample type, the stacks and what their counts
/// are multiplied by (`cpu/nanoseconds` is samples x period), and the
/// labels of its samples (a slot's number, leader flag, phase).
pub struct Part<'a> {
    pub columns: Vec<(&'a Folded, i64)>,
    pub labels: Vec<(&'static str, LabelValue)>,
}

/// Adds `part`'s stacks to `b`: a sample per stack, labelled with its
/// thread (`thread_name`, from its root frame) and the part's labels.
pub fn add_part(b: &mut Builder, part: &Part<'_>) {
    let width = part.columns.len();
    // Stack -> values, one column per input.
    let mut merged: HashMap<&str, Vec<i64>> = HashMap::new();
    for (col, (folded, scale)) in part.columns.iter().enumerate() {
        for (stack, value) in folded.iter() {
            merged.entry(stack).or_insert_with(|| vec![0; width])[col] +=
                (value as i64).saturating_mul(*scale);
        }
    }
    let mut stacks: Vec<_> = merged.into_iter().collect();
    stacks.sort();
    for (stack, value) in stacks {
        b.folded_sample(stack, value, &part.labels);
    }
}

/// A profile from its gzipped encoding (what [`Builder::write_gzip`] wrote).
pub fn decode_gzip(bytes: &[u8]) -> std::io::Result<Profile> {
    use std::io::Read;
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(bytes).read_to_end(&mut raw)?;
    Profile::decode(&raw[..]).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn columns_keep_their_totals_through_encoding() {
        let mut on = Folded::new();
        on.add(["t", "main", "hot"], 7);
        on.add(["t", "main"], 1);
        let mut off = Folded::new();
        off.add(["t", "main", "sleep"], 5_000_000);
        off.add(["t", "main"], 10);
        let types = [
            SampleType::new("samples", "count"),
            SampleType::new("offcpu", "nanoseconds"),
        ];
        let mut b = Builder::new(&types);
        add_part(
            &mut b,
            &Part {
                columns: vec![(&on, 1), (&off, 1)],
                labels: Vec::new(),
            },
        );
        let bytes = b.gzip(&ProfileMeta::default()).unwrap();
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_end(&mut raw)
            .unwrap();
        let back = Profile::decode(&raw[..]).unwrap();
        let total = |i: usize| back.sample.iter().map(|s| s.value[i]).sum::<i64>();
        assert_eq!(total(0), 8);
        assert_eq!(total(1), 5_000_010);
        assert_eq!(back.sample.len(), 3);
        // Leaf first: the first location of the `hot` sample is `hot`; the
        // thread is a label, not a frame.
        let hot = back.sample.iter().find(|s| s.value[0] == 7).unwrap();
        let name = |loc: u64| {
            let l = &back.location[loc as usize - 1];
            let f = &back.function[l.line[0].function_id as usize - 1];
            back.string_table[f.name as usize].clone()
        };
        let names: Vec<String> = hot.location_id.iter().map(|&l| name(l)).collect();
        assert_eq!(names, ["hot", "main"]);
        let label = &hot.label[0];
        assert_eq!(back.string_table[label.key as usize], "thread_name");
        assert_eq!(back.string_table[label.str as usize], "t");
    }

    #[test]
    fn labels_mappings_and_inlined_frames() {
        let mut b = Builder::new(&[
            SampleType::new("samples", "count"),
            SampleType::new("cpu", "nanoseconds"),
        ]);
        let exe = MappingInfo {
            start: 0x5555_0000_0000,
            limit: 0x5555_0010_0000,
            offset: 0x1000,
            file: "/usr/bin/agave-validator".into(),
            build_id: "b6bbd8568fb71888".into(),
        };
        let m = b.mapping(&exe);
        assert_eq!(b.mapping(&exe), m, "interned");
        let line = |f: &str| FrameLine {
            function: f.into(),
            ..Default::default()
        };
        // An inlined call: one location, two lines, innermost first.
        let leaf = Frame {
            address: 0x5555_0000_1234,
            mapping: Some(m),
            lines: vec![line("inlined_helper"), line("outer")],
        };
        let root = Frame {
            address: 0x5555_0000_0100,
            mapping: Some(m),
            lines: vec![line("main")],
        };
        let (l0, l1) = (b.location(&leaf), b.location(&root));
        assert_eq!(b.location(&leaf), l0);
        b.sample(
            vec![l0, l1],
            vec![3, 30_000_000],
            &[
                ("thread_name", LabelValue::Str("solBanknStgTx00".into())),
                ("thread_id", LabelValue::Num(4242, None)),
                ("slot", LabelValue::Num(312_000_123, None)),
            ],
        );
        let meta = ProfileMeta {
            time_nanos: 1,
            duration_nanos: 400_000_000,
            ..Default::default()
        };
        let p = b.finish(&meta).unwrap();
        let back = Profile::decode(&p.encode_to_vec()[..]).unwrap();
        assert_eq!(back.mapping.len(), 1);
        let mapping = &back.mapping[0];
        assert_eq!(back.string_table[mapping.build_id as usize], "b6bbd8568fb71888");
        assert_eq!(
            (mapping.memory_start, mapping.file_offset),
            (0x5555_0000_0000, 0x1000)
        );
        assert_eq!(back.location.len(), 2);
        assert_eq!(back.location[0].line.len(), 2);
        assert_eq!(back.location[0].address, 0x5555_0000_1234);
        assert_eq!(back.location[0].mapping_id, 1);
        let s = &back.sample[0];
        let slot = s
            .label
            .iter()
            .find(|l| back.string_table[l.key as usize] == "slot")
            .unwrap();
        assert_eq!(slot.num, 312_000_123);
        assert_eq!(back.duration_nanos, 400_000_000);
    }

    #[test]
    fn samples_past_the_memory_bound_go_through_a_temporary_file() {
        let mut b = Builder::new(&[SampleType::new("samples", "count")]);
        b.samples.limit = 256;
        for i in 0..1000 {
            b.folded_sample(
                &format!("t;main;f{}", i % 7),
                vec![i],
                &[("slot", LabelValue::Num(i / 10, Some("count")))],
            );
        }
        assert!(b.samples.file.is_some(), "spilled");
        assert_eq!(b.samples.count, 1000);
        let p = b.finish(&ProfileMeta::default()).unwrap();
        assert_eq!(p.sample.len(), 1000);
        assert_eq!(p.sample.iter().map(|s| s.value[0]).sum::<i64>(), 999 * 1000 / 2);
        // In order, each with its own labels.
        let slot = |s: &Sample| {
            s.label
                .iter()
                .find(|l| p.string_table[l.key as usize] == "slot")
                .unwrap()
                .num
        };
        assert!(p.sample.iter().enumerate().all(|(i, s)| slot(s) == i as i64 / 10));
        assert_eq!(p.location.len(), 8, "main and f0..f6");
    }
}
