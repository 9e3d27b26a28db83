//! pprof profiles (`profile.proto`, gzipped), readable by `go tool pprof`,
//! pprof.me, Grafana Pyroscope and speedscope.

use std::{collections::HashMap, io::Write};

use pprof::protos::{Function, Line, Location, Message, Profile, Sample, ValueType};

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

/// Builds one profile with a value column per `(type, stacks)` pair. A stack
/// present in several columns is one sample with several values; the total
/// of each column equals that `Folded`'s total.
pub fn build(columns: &[(SampleType, &Folded)], meta: &ProfileMeta) -> Profile {
    let mut strings = Strings::new();
    let sample_type = columns
        .iter()
        .map(|(t, _)| ValueType {
            ty: strings.id(&t.kind),
            unit: strings.id(&t.unit),
        })
        .collect();

    // Stack -> values, one column per input.
    let mut merged: HashMap<&str, Vec<i64>> = HashMap::new();
    for (col, (_, folded)) in columns.iter().enumerate() {
        for (stack, value) in folded.iter() {
            merged.entry(stack).or_insert_with(|| vec![0; columns.len()])[col] += value as i64;
        }
    }
    let mut stacks: Vec<_> = merged.into_iter().collect();
    stacks.sort();

    let mut functions: Vec<Function> = Vec::new();
    let mut locations: Vec<Location> = Vec::new();
    let mut location_of: HashMap<String, u64> = HashMap::new();
    let mut samples = Vec::with_capacity(stacks.len());
    for (stack, value) in stacks {
        // pprof lists locations leaf first.
        let location_id = stack
            .split(';')
            .rev()
            .map(|frame| {
                if let Some(&id) = location_of.get(frame) {
                    return id;
                }
                let id = functions.len() as u64 + 1;
                let name = strings.id(frame);
                functions.push(Function {
                    id,
                    name,
                    system_name: name,
                    ..Default::default()
                });
                locations.push(Location {
                    id,
                    line: vec![Line {
                        function_id: id,
                        line: 0,
                    }],
                    ..Default::default()
                });
                location_of.insert(frame.to_string(), id);
                id
            })
            .collect();
        samples.push(Sample {
            location_id,
            value,
            label: vec![],
        });
    }

    let period_type = meta.period_type.as_ref().map(|t| ValueType {
        ty: strings.id(&t.kind),
        unit: strings.id(&t.unit),
    });
    let comment = meta.comments.iter().map(|c| strings.id(c)).collect();
    Profile {
        sample_type,
        sample: samples,
        location: locations,
        function: functions,
        time_nanos: meta.time_nanos,
        duration_nanos: meta.duration_nanos,
        period_type,
        period: meta.period,
        comment,
        string_table: strings.table,
        ..Default::default()
    }
}

/// The gzipped protobuf encoding of a profile, as pprof tools expect it.
pub fn encode_gzip(profile: &Profile) -> std::io::Result<Vec<u8>> {
    let raw = profile.encode_to_vec();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&raw)?;
    gz.finish()
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
        let p = build(
            &[
                (SampleType::new("samples", "count"), &on),
                (SampleType::new("offcpu", "nanoseconds"), &off),
            ],
            &ProfileMeta::default(),
        );
        let bytes = encode_gzip(&p).unwrap();
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_end(&mut raw)
            .unwrap();
        let back = Profile::decode(&raw[..]).unwrap();
        let total = |i: usize| back.sample.iter().map(|s| s.value[i]).sum::<i64>();
        assert_eq!(total(0), 8);
        assert_eq!(total(1), 5_000_010);
        assert_eq!(back.sample.len(), 3);
        // Leaf first: the first location of the `hot` sample is `hot`.
        let hot = back.sample.iter().find(|s| s.value[0] == 7).unwrap();
        let f = &back.function[hot.location_id[0] as usize - 1];
        assert_eq!(back.string_table[f.name as usize], "hot");
    }
}
