//! Symbolization time for N unique stack addresses, cold and warm: user
//! addresses in this benchmark's own executable (a Rust binary with debug
//! info, inlined frames included) and kernel addresses from /proc/kallsyms.
//! `cargo bench -p symbolizer --bench symbolize [-- N]`; one JSON line.
//!
//! cold: a new symbolizer (the ELF and DWARF are parsed on the way);
//! warm: N other addresses once they are parsed; cached: the same N again.

use std::time::Instant;

use object::{Object, ObjectSymbol, SymbolKind};
use symbolizer::Symbolizer;

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2000);
    let exe = std::fs::read("/proc/self/exe").expect("read own executable");
    let file = object::File::parse(&*exe).expect("parse own executable");
    let mut funcs: Vec<u64> = file
        .symbols()
        .filter(|s| s.kind() == SymbolKind::Text && s.size() > 8)
        .map(|s| s.address())
        .collect();
    funcs.sort_unstable();
    funcs.dedup();
    let step = (funcs.len() / n).max(1);
    let funcs: Vec<u64> = funcs.into_iter().step_by(step).take(n).collect();
    // PIE: the mapping at file offset 0 starts at the load bias.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let me = std::fs::read_link("/proc/self/exe").unwrap();
    let bias = maps
        .lines()
        .find(|l| l.ends_with(me.to_str().unwrap()) && l.split_whitespace().nth(2) == Some("00000000"))
        .and_then(|l| u64::from_str_radix(l.split('-').next()?, 16).ok())
        .expect("own mapping");
    let pid = std::process::id();
    let user = |sym: &mut Symbolizer, delta: u64| -> (f64, usize) {
        let t = Instant::now();
        let mut named = 0;
        for &a in &funcs {
            let f = sym.user_frame(pid, bias + a + delta, false);
            named += usize::from(!f[0].starts_with("[unknown]"));
        }
        (t.elapsed().as_secs_f64(), named)
    };
    let mut sym = Symbolizer::new();
    sym.track_process(pid).unwrap();
    let (user_cold, named) = user(&mut sym, 2);
    let (user_warm, _) = user(&mut sym, 4);
    let (user_cached, _) = user(&mut sym, 4);

    // Kernel text symbols (root sees real addresses).
    let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
    let mut kaddrs: Vec<u64> = kallsyms
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let a = u64::from_str_radix(it.next()?, 16).ok()?;
            matches!(it.next()?, "t" | "T").then_some(a)
        })
        .filter(|&a| a != 0)
        .collect();
    kaddrs.sort_unstable();
    let kstep = (kaddrs.len() / n).max(1);
    let kaddrs: Vec<u64> = kaddrs.into_iter().step_by(kstep).take(n).collect();
    let kernel = |sym: &mut Symbolizer, delta: u64| -> f64 {
        let t = Instant::now();
        for &a in &kaddrs {
            std::hint::black_box(sym.kernel_frame(a + delta, false));
        }
        t.elapsed().as_secs_f64()
    };
    let mut ksym = Symbolizer::new();
    let kernel_cold = kernel(&mut ksym, 1);
    let kernel_warm = kernel(&mut ksym, 2);
    let kernel_cached = kernel(&mut ksym, 2);
    println!(
        "{{\"user_addresses\":{},\"user_named\":{named},\"user_cold_s\":{user_cold:.4},\"user_warm_s\":{user_warm:.4},\
         \"user_cached_s\":{user_cached:.6},\"kernel_addresses\":{},\"kernel_cold_s\":{kernel_cold:.4},\
         \"kernel_warm_s\":{kernel_warm:.4},\"kernel_cached_s\":{kernel_cached:.6}}}",
        funcs.len(),
        kaddrs.len()
    );
}
