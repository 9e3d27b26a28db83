//! OTLP profiles: a pprof [`Profile`] as the OpenTelemetry profiles signal
//! (`opentelemetry.proto.collector.profiles.v1development`, the messages
//! of the OpenTelemetry proto package), for an OTLP/HTTP receiver (an
//! OpenTelemetry Collector, Grafana Pyroscope, ...).
//!
//! One OTLP profile per pprof sample type (OTLP gives each profile one
//! sample type), sharing one dictionary: its strings, mappings (with the
//! GNU build ID as the `process.executable.build_id.gnu` attribute),
//! locations (address and lines, inlined calls as extra lines), functions,
//! stacks and attributes (the pprof labels: a numeric label keeps its
//! unit). Samples whose value of that type is 0 are left out of its
//! profile. pprof's comments have no place in OTLP and are not carried.

use std::{collections::HashMap, hash::BuildHasher};

pub use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceResponse;
use opentelemetry_proto::tonic::{
    collector::profiles::v1development::ExportProfilesServiceRequest,
    common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue},
    profiles::v1development as otlp,
    resource::v1::Resource,
};
use prost014::Message;

use crate::pprof::Profile;

/// The OTLP/HTTP path of the profiles signal.
pub const HTTP_PATH: &str = "/v1development/profiles";
/// The attribute a mapping's GNU build ID is carried in (semantic conventions).
pub const BUILD_ID_ATTRIBUTE: &str = "process.executable.build_id.gnu";

/// Interns into a dictionary table whose entry 0 is the zero value.
struct Table<K, V> {
    items: Vec<V>,
    index: HashMap<K, i32>,
}

impl<K: std::hash::Hash + Eq, V: Default> Table<K, V> {
    /// A table holding the zero value, which is also `zero_key`'s.
    fn new(zero_key: K) -> Self {
        Self {
            items: vec![V::default()],
            index: HashMap::from([(zero_key, 0)]),
        }
    }

    fn id(&mut self, key: K, make: impl FnOnce() -> V) -> i32 {
        *self.index.entry(key).or_insert_with(|| {
            self.items.push(make());
            (self.items.len() - 1) as i32
        })
    }
}

/// An attribute's identity in the dictionary: key, value, unit.
#[derive(Hash, PartialEq, Eq)]
enum AttrValue {
    Str(String),
    Int(i64),
}

/// The dictionary being built from one pprof profile: its tables, and
/// where each pprof id went.
struct Dictionary<'p> {
    p: &'p Profile,
    strings: Table<String, String>,
    attributes: Table<(i32, AttrValue, i32), otlp::KeyValueAndUnit>,
    stacks: Table<Vec<i32>, otlp::Stack>,
    mappings: Vec<otlp::Mapping>,
    functions: Vec<otlp::Function>,
    locations: Vec<otlp::Location>,
    mapping_index: HashMap<u64, i32>,
    function_index: HashMap<u64, i32>,
    location_index: HashMap<u64, i32>,
}

impl<'p> Dictionary<'p> {
    fn new(p: &'p Profile) -> Self {
        Self {
            p,
            strings: Table::new(String::new()),
            attributes: Table::new((0, AttrValue::Str(String::new()), 0)),
            stacks: Table::new(Vec::new()),
            mappings: vec![otlp::Mapping::default()],
            functions: vec![otlp::Function::default()],
            locations: vec![otlp::Location::default()],
            mapping_index: HashMap::new(),
            function_index: HashMap::new(),
            location_index: HashMap::new(),
        }
    }

    /// A pprof string by its index.
    fn s(&self, i: i64) -> &'p str {
        self.p
            .string_table
            .get(i as usize)
            .map(String::as_str)
            .unwrap_or("")
    }

    fn string(&mut self, text: &str) -> i32 {
        self.strings.id(text.to_string(), || text.to_string())
    }

    fn attribute(&mut self, key: &str, value: AttrValue, unit: &str) -> i32 {
        let (k, u) = (self.string(key), self.string(unit));
        let any = match &value {
            AttrValue::Str(v) => any_value::Value::StringValue(v.clone()),
            AttrValue::Int(n) => any_value::Value::IntValue(*n),
        };
        self.attributes.id((k, value, u), || otlp::KeyValueAndUnit {
            key_strindex: k,
            value: Some(AnyValue { value: Some(any) }),
            unit_strindex: u,
        })
    }

    /// Mappings (with their build IDs), functions and locations.
    fn tables(&mut self) {
        let p = self.p;
        for m in &p.mapping {
            let mut attribute_indices = Vec::new();
            if !self.s(m.build_id).is_empty() {
                let id = AttrValue::Str(self.s(m.build_id).to_string());
                attribute_indices.push(self.attribute(BUILD_ID_ATTRIBUTE, id, ""));
            }
            self.mapping_index.insert(m.id, self.mappings.len() as i32);
            let filename_strindex = self.string(self.s(m.filename));
            self.mappings.push(otlp::Mapping {
                memory_start: m.memory_start,
                memory_limit: m.memory_limit,
                file_offset: m.file_offset,
                filename_strindex,
                attribute_indices,
            });
        }
        for f in &p.function {
            self.function_index.insert(f.id, self.functions.len() as i32);
            let function = otlp::Function {
                name_strindex: self.string(self.s(f.name)),
                system_name_strindex: self.string(self.s(f.system_name)),
                filename_strindex: self.string(self.s(f.filename)),
                start_line: f.start_line,
            };
            self.functions.push(function);
        }
        for l in &p.location {
            self.location_index.insert(l.id, self.locations.len() as i32);
            let lines = l
                .line
                .iter()
                .map(|line| otlp::Line {
                    function_index: self.function_index.get(&line.function_id).copied().unwrap_or(0),
                    line: line.line,
                    column: 0,
                })
                .collect();
            self.locations.push(otlp::Location {
                mapping_index: self.mapping_index.get(&l.mapping_id).copied().unwrap_or(0),
                address: l.address,
                lines,
                attribute_indices: Vec::new(),
            });
        }
    }

    /// A sample's stack and attributes (its labels; a number keeps its unit).
    fn sample(&mut self, sample: &crate::pprof::Sample) -> (i32, Vec<i32>) {
        let locations: Vec<i32> = sample
            .location_id
            .iter()
            .map(|id| self.location_index.get(id).copied().unwrap_or(0))
            .collect();
        let stack = self.stacks.id(locations.clone(), || otlp::Stack {
            location_indices: locations,
        });
        let attrs = sample
            .label
            .iter()
            .map(|l| {
                let value = if l.str != 0 {
                    AttrValue::Str(self.s(l.str).to_string())
                } else {
                    AttrValue::Int(l.num)
                };
                self.attribute(self.s(l.key), value, self.s(l.num_unit))
            })
            .collect();
        (stack, attrs)
    }

    fn value_type(&mut self, t: &pprof::protos::ValueType) -> otlp::ValueType {
        otlp::ValueType {
            type_strindex: self.string(self.s(t.ty)),
            unit_strindex: self.string(self.s(t.unit)),
        }
    }

    fn finish(self) -> otlp::ProfilesDictionary {
        otlp::ProfilesDictionary {
            mapping_table: self.mappings,
            location_table: self.locations,
            function_table: self.functions,
            link_table: vec![otlp::Link::default()],
            string_table: self.strings.items,
            attribute_table: self.attributes.items,
            stack_table: self.stacks.items,
        }
    }
}

/// The request carrying `p`: `resource` is the node's attributes
/// (`service.name`, `host.name`, ...), `scope` the producer's name and
/// version. The sample types named in `measured` are measured, not
/// sampled (off-CPU time): their profiles carry no sampling period.
pub fn request(
    p: &Profile,
    resource: &[(&str, String)],
    scope: (&str, &str),
    measured: &[&str],
) -> ExportProfilesServiceRequest {
    let mut d = Dictionary::new(p);
    d.tables();
    // Each sample's stack and attributes, once for every profile.
    let shared: Vec<(i32, Vec<i32>)> = p.sample.iter().map(|sample| d.sample(sample)).collect();
    let id = profile_id();
    let period_type = p.period_type.as_ref().map(|t| d.value_type(t));
    let profiles = p
        .sample_type
        .iter()
        .enumerate()
        .map(|(column, t)| {
            let mut profile_id = id;
            profile_id[15] ^= column as u8;
            let sampled = !measured.contains(&d.s(t.ty));
            otlp::Profile {
                sample_type: Some(d.value_type(t)),
                samples: p
                    .sample
                    .iter()
                    .zip(&shared)
                    .filter_map(|(sample, (stack, attrs))| {
                        let v = sample.value.get(column).copied().unwrap_or(0);
                        (v != 0).then(|| otlp::Sample {
                            stack_index: *stack,
                            attribute_indices: attrs.clone(),
                            link_index: 0,
                            values: vec![v],
                            timestamps_unix_nano: Vec::new(),
                        })
                    })
                    .collect(),
                time_unix_nano: p.time_nanos.max(0) as u64,
                duration_nano: p.duration_nanos.max(0) as u64,
                period_type: period_type.filter(|_| sampled),
                period: if sampled { p.period } else { 0 },
                profile_id: profile_id.to_vec(),
                dropped_attributes_count: 0,
                original_payload_format: String::new(),
                original_payload: Vec::new(),
                attribute_indices: Vec::new(),
            }
        })
        .collect();
    let kv = |k: &str, v: &str| KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.to_string())),
        }),
        key_strindex: 0,
    };
    ExportProfilesServiceRequest {
        resource_profiles: vec![otlp::ResourceProfiles {
            resource: Some(Resource {
                attributes: resource.iter().map(|(k, v)| kv(k, v)).collect(),
                ..Default::default()
            }),
            scope_profiles: vec![otlp::ScopeProfiles {
                scope: Some(InstrumentationScope {
                    name: scope.0.to_string(),
                    version: scope.1.to_string(),
                    ..Default::default()
                }),
                profiles,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
        dictionary: Some(d.finish()),
    }
}

/// The request's protobuf encoding (the body of an OTLP/HTTP export).
pub fn encode(r: &ExportProfilesServiceRequest) -> Vec<u8> {
    r.encode_to_vec()
}

/// A response's partial success: profiles the receiver rejected, and why.
pub fn rejected(body: &[u8]) -> Option<(i64, String)> {
    let r = ExportProfilesServiceResponse::decode(body).ok()?;
    let p = r.partial_success?;
    (p.rejected_profiles > 0 || !p.error_message.is_empty()).then_some((p.rejected_profiles, p.error_message))
}

/// 16 random bytes, never all zero (OTLP's profile_id).
fn profile_id() -> [u8; 16] {
    let state = std::collections::hash_map::RandomState::new();
    let a = state.hash_one(std::time::SystemTime::now());
    let b = state.hash_one(a);
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&a.to_le_bytes());
    id[8..].copy_from_slice(&b.to_le_bytes());
    id[0] |= 1;
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pprof::{Builder, LabelValue, MappingInfo, ProfileMeta, SampleType};

    /// Decodes `r` again and reads every sample back as (profile type,
    /// function names root first, attributes, value).
    fn read_back(r: &ExportProfilesServiceRequest) -> Vec<(String, Vec<String>, Vec<String>, i64)> {
        let r = ExportProfilesServiceRequest::decode(&encode(r)[..]).unwrap();
        let d = r.dictionary.unwrap();
        let s = |i: i32| d.string_table[i as usize].clone();
        let mut out = Vec::new();
        for p in &r.resource_profiles[0].scope_profiles[0].profiles {
            let t = p.sample_type.unwrap();
            let ty = format!("{}/{}", s(t.type_strindex), s(t.unit_strindex));
            for sample in &p.samples {
                let mut names: Vec<String> = d.stack_table[sample.stack_index as usize]
                    .location_indices
                    .iter()
                    .flat_map(|&l| {
                        let loc = &d.location_table[l as usize];
                        loc.lines
                            .iter()
                            .map(|line| s(d.function_table[line.function_index as usize].name_strindex))
                            .collect::<Vec<_>>()
                    })
                    .collect();
                names.reverse();
                let attrs = sample
                    .attribute_indices
                    .iter()
                    .map(|&a| {
                        let a = &d.attribute_table[a as usize];
                        let v = match a.value.as_ref().unwrap().value.as_ref().unwrap() {
                            any_value::Value::StringValue(v) => v.clone(),
                            any_value::Value::IntValue(n) => n.to_string(),
                            other => format!("{other:?}"),
                        };
                        format!("{}={}{}", s(a.key_strindex), v, s(a.unit_strindex))
                    })
                    .collect();
                out.push((ty.clone(), names, attrs, sample.values[0]));
            }
        }
        out
    }

    #[test]
    fn samples_stacks_labels_and_mappings_survive_the_conversion() {
        let mut b = Builder::new(&[
            SampleType::new("samples", "count"),
            SampleType::new("offcpu", "nanoseconds"),
        ]);
        let m = b.mapping(&MappingInfo {
            start: 0x1000,
            limit: 0x5000,
            offset: 0,
            file: "/bin/x".into(),
            build_id: "abcd".into(),
        });
        let _ = m;
        // The root (the thread) is a label, not a frame.
        let stack = b.folded_locations("t;main;hot");
        b.sample(
            stack.clone(),
            vec![3, 0],
            &[
                ("thread_name", LabelValue::Str("t".into())),
                ("slot", LabelValue::Num(7, Some("count"))),
            ],
        );
        b.sample(
            stack,
            vec![0, 5_000],
            &[("slot", LabelValue::Num(8, Some("count")))],
        );
        let meta = ProfileMeta {
            time_nanos: 1_000,
            duration_nanos: 400_000_000,
            period_type: Some(SampleType::new("cpu", "nanoseconds")),
            period: 20_408_163,
            comments: vec!["a comment".into()],
        };
        let p = b.finish(&meta).unwrap();
        let r = request(
            &p,
            &[("service.name", "agave".into())],
            ("slotprof", "0.1.0"),
            &["offcpu"],
        );
        let back = read_back(&r);
        assert_eq!(
            back,
            vec![
                (
                    "samples/count".to_string(),
                    vec!["main".to_string(), "hot".into()],
                    vec!["thread_name=t".to_string(), "slot=7count".into()],
                    3
                ),
                (
                    "offcpu/nanoseconds".to_string(),
                    vec!["main".to_string(), "hot".into()],
                    vec!["slot=8count".to_string()],
                    5_000
                ),
            ]
        );
        let d = r.dictionary.as_ref().unwrap();
        // Every table starts with its zero value, and has it once.
        assert_eq!(d.string_table[0], "");
        assert_eq!(d.string_table.iter().filter(|s| s.is_empty()).count(), 1);
        assert_eq!(d.mapping_table[0], otlp::Mapping::default());
        assert_eq!(d.stack_table[0], otlp::Stack::default());
        assert_eq!(d.attribute_table[0], otlp::KeyValueAndUnit::default());
        // The mapping and its build ID.
        let m = &d.mapping_table[1];
        assert_eq!((m.memory_start, m.memory_limit), (0x1000, 0x5000));
        assert_eq!(d.string_table[m.filename_strindex as usize], "/bin/x");
        let a = &d.attribute_table[m.attribute_indices[0] as usize];
        assert_eq!(d.string_table[a.key_strindex as usize], BUILD_ID_ATTRIBUTE);
        let profiles = &r.resource_profiles[0].scope_profiles[0].profiles;
        assert_eq!(profiles.len(), 2);
        assert_ne!(profiles[0].profile_id, profiles[1].profile_id);
        assert_eq!(profiles[0].period, 20_408_163);
        // Off-CPU time is measured, not sampled: no period.
        assert_eq!((profiles[1].period, profiles[1].period_type), (0, None));
        assert_eq!(
            (profiles[0].time_unix_nano, profiles[0].duration_nano),
            (1_000, 400_000_000)
        );
    }
}
