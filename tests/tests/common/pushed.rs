//! What pushed profiles carry, read back the published ways (Pyroscope's
//! multipart pprof upload, OTLP's ExportProfilesServiceRequest with the
//! OpenTelemetry proto package's messages), as [`Content`] comparable to
//! the profiles on disk; and /metrics scraped for the push counts.

use std::{collections::BTreeMap, path::Path, time::Duration};

use opentelemetry_proto::tonic::{
    collector::profiles::v1development::ExportProfilesServiceRequest, common::v1::any_value,
};
use prost014::Message;
use slotprof_tests::http_receiver::{HttpReceiver, Request};

use super::http_get;

/// (slot, profile type, stack, labels) -> value.
pub type Content = BTreeMap<(i64, String, Vec<String>, Vec<String>), i64>;

pub fn label_text(key: &str, value: String, unit: &str) -> String {
    if unit.is_empty() {
        format!("{key}={value}")
    } else {
        format!("{key}={value}[{unit}]")
    }
}

/// A pprof profile's samples as [`Content`] (a sample without a slot
/// label counts as slot -1).
pub fn pprof_content(p: &flamegraphs::pprof::Profile, into: &mut Content) {
    let s = |i: i64| p.string_table[i as usize].clone();
    let locations: BTreeMap<u64, &pprof::protos::Location> = p.location.iter().map(|l| (l.id, l)).collect();
    let functions: BTreeMap<u64, String> = p.function.iter().map(|f| (f.id, s(f.name))).collect();
    let mappings: BTreeMap<u64, String> = p.mapping.iter().map(|m| (m.id, s(m.filename))).collect();
    for sample in &p.sample {
        let mut stack = Vec::new();
        for id in &sample.location_id {
            let l = locations[id];
            if l.line.is_empty() {
                stack.push(format!(
                    "{:#x}@{}",
                    l.address,
                    mappings.get(&l.mapping_id).cloned().unwrap_or_default()
                ));
            }
            stack.extend(l.line.iter().map(|line| functions[&line.function_id].clone()));
        }
        let mut slot = -1;
        let mut labels: Vec<String> = sample
            .label
            .iter()
            .map(|l| {
                if s(l.key) == "slot" {
                    slot = l.num;
                }
                let v = if l.str != 0 { s(l.str) } else { l.num.to_string() };
                label_text(&s(l.key), v, &s(l.num_unit))
            })
            .collect();
        labels.sort();
        for (i, t) in p.sample_type.iter().enumerate() {
            let v = sample.value[i];
            if v != 0 {
                *into
                    .entry((
                        slot,
                        format!("{}/{}", s(t.ty), s(t.unit)),
                        stack.clone(),
                        labels.clone(),
                    ))
                    .or_default() += v;
            }
        }
    }
}

/// An OTLP request's samples as [`Content`]; checks the dictionary's
/// zero entries on the way.
pub fn otlp_content(r: &ExportProfilesServiceRequest, into: &mut Content) {
    let d = r.dictionary.as_ref().expect("a dictionary");
    assert_eq!(d.string_table[0], "", "string_table[0] must be \"\"");
    assert_eq!(
        d.stack_table[0].location_indices.len(),
        0,
        "stack_table[0] must be empty"
    );
    let s = |i: i32| d.string_table[i as usize].clone();
    for rp in &r.resource_profiles {
        for sp in &rp.scope_profiles {
            for p in &sp.profiles {
                let t = p.sample_type.expect("a sample type");
                let ty = format!("{}/{}", s(t.type_strindex), s(t.unit_strindex));
                for sample in &p.samples {
                    let mut stack = Vec::new();
                    for &li in &d.stack_table[sample.stack_index as usize].location_indices {
                        let l = &d.location_table[li as usize];
                        if l.lines.is_empty() {
                            let m = &d.mapping_table[l.mapping_index as usize];
                            stack.push(format!("{:#x}@{}", l.address, s(m.filename_strindex)));
                        }
                        stack.extend(
                            l.lines
                                .iter()
                                .map(|line| s(d.function_table[line.function_index as usize].name_strindex)),
                        );
                    }
                    let mut slot = -1;
                    let mut labels: Vec<String> = sample
                        .attribute_indices
                        .iter()
                        .map(|&a| {
                            let a = &d.attribute_table[a as usize];
                            let v = match a.value.as_ref().and_then(|v| v.value.as_ref()) {
                                Some(any_value::Value::StringValue(v)) => v.clone(),
                                Some(any_value::Value::IntValue(n)) => {
                                    if s(a.key_strindex) == "slot" {
                                        slot = *n;
                                    }
                                    n.to_string()
                                }
                                other => panic!("an attribute of an unexpected kind: {other:?}"),
                            };
                            label_text(&s(a.key_strindex), v, &s(a.unit_strindex))
                        })
                        .collect();
                    labels.sort();
                    assert_eq!(sample.values.len(), 1);
                    *into.entry((slot, ty.clone(), stack, labels)).or_default() += sample.values[0];
                }
            }
        }
    }
}

/// Every slot's profile on disk as [`Content`].
pub fn disk_content(export: &Path) -> (Content, Vec<i64>) {
    let mut c = Content::new();
    let mut slots = Vec::new();
    for e in std::fs::read_dir(export.join("slots")).unwrap().flatten() {
        let Ok(n) = e.file_name().to_string_lossy().parse::<i64>() else {
            continue;
        };
        slots.push(n);
        let p =
            flamegraphs::pprof::decode_gzip(&std::fs::read(e.path().join("profile.pb.gz")).unwrap()).unwrap();
        pprof_content(&p, &mut c);
    }
    slots.sort();
    (c, slots)
}

/// The gzipped pprof in a Pyroscope ingest request's multipart `profile`
/// field.
pub fn multipart_profile(req: &Request) -> Vec<u8> {
    let ct = req.header("content-type").expect("a content type");
    let boundary = ct
        .split(';')
        .find_map(|p| p.trim().strip_prefix("boundary="))
        .unwrap_or_else(|| panic!("a multipart form, got {ct}"));
    let delimiter = format!("--{boundary}");
    let body = &req.body;
    let find = |from: usize, what: &[u8]| {
        body[from..]
            .windows(what.len())
            .position(|w| w == what)
            .map(|i| i + from)
    };
    let mut at = find(0, delimiter.as_bytes()).expect("the first boundary");
    loop {
        let head_start = at + delimiter.len() + 2;
        let head_end = find(head_start, b"\r\n\r\n").expect("a part's head");
        let head = String::from_utf8_lossy(&body[head_start..head_end]).to_string();
        let next = find(head_end, format!("\r\n{delimiter}").as_bytes()).expect("the part's end");
        if head.contains("name=\"profile\"") {
            return body[head_end + 4..next].to_vec();
        }
        at = next + 2;
        assert!(
            !body[at + delimiter.len()..].starts_with(b"--"),
            "no `profile` field"
        );
    }
}

/// What a Pyroscope receiver got, checked request by request: the path,
/// the query (application and series labels, no slot among them), the
/// form; the profiles' content.
pub fn pyroscope_content(reqs: &[(Request, u16)], app: &str, identity: Option<&str>) -> Content {
    let mut c = Content::new();
    for (req, status) in reqs.iter().filter(|(_, s)| *s == 200) {
        let _ = status;
        assert_eq!(
            (req.method.as_str(), req.path()),
            ("POST", "/ingest"),
            "{}",
            req.target
        );
        let name = req.query("name").expect("name=");
        assert!(
            name.starts_with(&format!("{app}{{")) && name.ends_with('}'),
            "the application and its series labels: {name}"
        );
        match identity {
            Some(id) => assert!(
                name.contains(&format!("identity={id}")),
                "no identity={id} in {name}"
            ),
            None => assert!(!name.contains("identity="), "an identity without an RPC: {name}"),
        }
        for want in [
            "cluster=e2e".to_string(),
            format!(
                "hostname={}",
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .unwrap()
                    .trim()
            ),
            "slotprof_version=".to_string(),
        ] {
            assert!(name.contains(&want), "{want} is not in {name}");
        }
        assert!(
            !name.contains("slot="),
            "a slot is a sample label, never a series label: {name}"
        );
        assert_eq!(req.query("format").as_deref(), Some("pprof"));
        let (from, until): (u64, u64) = (
            req.query("from").unwrap().parse().unwrap(),
            req.query("until").unwrap().parse().unwrap(),
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(
            from < until && until <= now + 1 && from + 3600 > now,
            "from {from} until {until} (now {now})"
        );
        let p = flamegraphs::pprof::decode_gzip(&multipart_profile(req)).expect("a gzipped pprof profile");
        assert!(p.time_nanos > 0 && p.duration_nanos > 0);
        pprof_content(&p, &mut c);
    }
    c
}

/// An OTLP request's body as protobuf (gunzipped by its Content-Encoding).
pub fn otlp_body(req: &Request) -> Vec<u8> {
    match req.header("content-encoding") {
        None => req.body.clone(),
        Some("gzip") => {
            let mut raw = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&req.body[..]), &mut raw)
                .expect("a gzipped body");
            raw
        }
        Some(other) => panic!("Content-Encoding {other}: OTLP/HTTP allows gzip"),
    }
}

/// What the OpenTelemetry proto package as published for Python (PyPI's
/// opentelemetry-proto, which `cargo xtask test` installs in
/// .tools/otlp-venv) reads in the OTLP requests that were taken: a
/// decoder independent of the Rust messages slotprof encodes with. `Err`
/// says why it could not be asked.
pub fn otlp_content_by_python(reqs: &[(Request, u16)], dir: &Path) -> Result<Content, String> {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = tests.join("../.tools/otlp-venv/bin/python");
    if !python.exists() {
        return Err(format!(
            "no {} (`cargo xtask test` installs it from PyPI)",
            python.display()
        ));
    }
    std::fs::create_dir_all(dir).unwrap();
    let mut files = Vec::new();
    for (i, (req, _)) in reqs.iter().filter(|(_, s)| *s == 200).enumerate() {
        let f = dir.join(format!("{i}.otlp"));
        std::fs::write(&f, otlp_body(req)).unwrap();
        files.push(f);
    }
    let o = std::process::Command::new(&python)
        .arg(tests.join("scripts/otlp_content.py"))
        .args(&files)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "otlp_content.py: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut c = Content::new();
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let ((slot, kind, stack, labels), value): ((i64, String, Vec<String>, Vec<String>), i64) =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("otlp_content.py said {line}: {e}"));
        *c.entry((slot, kind, stack, labels)).or_default() += value;
    }
    Ok(c)
}

/// What an OTLP receiver got, checked request by request: path, content
/// type, the node's resource attributes; the profiles' content.
pub fn otlp_received(reqs: &[(Request, u16)], app: &str, identity: Option<&str>) -> Content {
    let mut c = Content::new();
    for (req, _) in reqs.iter().filter(|(_, s)| *s == 200) {
        assert_eq!(
            (req.method.as_str(), req.path()),
            ("POST", "/v1development/profiles")
        );
        assert_eq!(req.header("content-type"), Some("application/x-protobuf"));
        let r = ExportProfilesServiceRequest::decode(&otlp_body(req)[..])
            .expect("an ExportProfilesServiceRequest");
        let attrs: BTreeMap<String, String> = r.resource_profiles[0]
            .resource
            .as_ref()
            .unwrap()
            .attributes
            .iter()
            .map(|kv| {
                let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                    Some(any_value::Value::StringValue(s)) => s.clone(),
                    other => format!("{other:?}"),
                };
                (kv.key.clone(), v)
            })
            .collect();
        assert_eq!(
            attrs.get("service.name").map(String::as_str),
            Some(app),
            "{attrs:?}"
        );
        assert_eq!(
            attrs.get("service.instance.id").map(String::as_str),
            identity,
            "{attrs:?}"
        );
        assert!(attrs.contains_key("host.name"), "{attrs:?}");
        assert_eq!(attrs.get("cluster").map(String::as_str), Some("e2e"), "{attrs:?}");
        // Sampled types carry the sampling period; off-CPU time is measured.
        let strings = &r.dictionary.as_ref().unwrap().string_table;
        for p in &r.resource_profiles[0].scope_profiles[0].profiles {
            let ty = &strings[p.sample_type.unwrap().type_strindex as usize];
            assert_eq!(
                p.period > 0 && p.period_type.is_some(),
                ty != "offcpu",
                "{ty}: period {} ({:?})",
                p.period,
                p.period_type
            );
        }
        otlp_content(&r, &mut c);
    }
    c
}

pub fn scrape(port: u16) -> BTreeMap<String, f64> {
    let text = http_get(port, "/metrics");
    let s = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    s.samples
        .into_iter()
        .filter(|x| {
            x.metric.starts_with("slotprof_push")
                || x.metric.starts_with("slotprof_slots_")
                || x.metric == "process_resident_memory_bytes"
                || x.metric == "slotprof_target_attached"
        })
        .map(|x| {
            let mut labels: Vec<String> = x
                .labels
                .iter()
                .filter(|(k, _)| *k != "url")
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            labels.sort();
            let v = match x.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            };
            (format!("{}{{{}}}", x.metric, labels.join(",")), v)
        })
        .collect()
}

pub fn metric(m: &BTreeMap<String, f64>, key: &str) -> f64 {
    *m.get(key)
        .unwrap_or_else(|| panic!("{key} is not in /metrics: {m:#?}"))
}

pub fn receiver(status: u16, delay: Duration) -> HttpReceiver {
    HttpReceiver::start(Box::new(move |_| (status, delay))).unwrap()
}

/// Keys of a scrape for one endpoint's metric.
pub fn key(metric: &str, endpoint: &str, result: Option<&str>) -> String {
    match result {
        Some(r) => format!("{metric}{{endpoint={endpoint},result={r}}}"),
        None => format!("{metric}{{endpoint={endpoint}}}"),
    }
}

/// The slots of a content.
pub fn slots_of(c: &Content) -> Vec<i64> {
    let mut s: Vec<i64> = c.keys().map(|k| k.0).collect();
    s.dedup();
    s
}

/// The part of `c` in `slots`.
pub fn only(c: &Content, slots: &[i64]) -> Content {
    c.iter()
        .filter(|(k, _)| slots.contains(&k.0))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

/// Where two contents differ: the first few keys each has that the other
/// has not (or with another value).
pub fn differences(a: &Content, b: &Content) -> String {
    let only = |x: &Content, y: &Content| {
        x.iter()
            .filter(|(k, v)| y.get(k) != Some(v))
            .take(5)
            .map(|(k, v)| format!("{k:?} = {v}"))
            .collect::<Vec<_>>()
    };
    format!("only pushed {:?}, only on disk {:?}", only(a, b), only(b, a))
}
