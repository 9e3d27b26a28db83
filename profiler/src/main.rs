static OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/profiler-ebpf"));
fn main() { println!("{}", OBJ.len()); }
