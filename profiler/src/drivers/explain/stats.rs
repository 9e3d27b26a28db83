//! The statistics of `slotprof explain`: how much likelier a bad slot is
//! when a stall class is present, with a confidence interval that stays
//! honest at small counts.
//!
//! Slots are counted like the incident counted blocks: bad slots among
//! exposed slots and among unexposed ones, each a Poisson count over its
//! number of slots. The rate ratio's 95% interval is the exact conditional
//! one: given the total of bad slots, the exposed share of them is
//! binomial, its Clopper-Pearson interval maps to the ratio. It needs no
//! large-count approximation, so it holds for 3 bad slots as for 300, and
//! it is what the incident's "4.8x (95% CI 3.4-6.9, Poisson)" is.
//!
//! Pure: unit tests check it against SciPy (figures in the tests, with the
//! commands that made them).

/// The regularized incomplete beta function I_x(a, b).
pub fn beta_inc(a: f64, b: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let ln_front = ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln();
    let front = ln_front.exp();
    // The continued fraction converges fast on this side of the mean; the
    // other side by symmetry.
    if x < (a + 1.0) / (a + b + 2.0) {
        front * beta_fraction(a, b, x) / a
    } else {
        1.0 - front * beta_fraction(b, a, 1.0 - x) / b
    }
}

/// The continued fraction of the incomplete beta function (modified
/// Lentz's method).
fn beta_fraction(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 - qab * x / qap;
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    for m in 1..=10_000 {
        let m = m as f64;
        let m2 = 2.0 * m;
        for aa in [
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ] {
            d = 1.0 + aa * d;
            if d.abs() < TINY {
                d = TINY;
            }
            c = 1.0 + aa / c;
            if c.abs() < TINY {
                c = TINY;
            }
            d = 1.0 / d;
            h *= d * c;
        }
        // The last factor of this round.
        if (d * c - 1.0).abs() < 1e-15 {
            break;
        }
    }
    h
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7, nine terms: ~15 significant digits).
pub fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Γ(x) Γ(1 - x) = π / sin(πx).
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut sum = C[0];
    for (i, c) in C.iter().enumerate().skip(1) {
        sum += c / (x + i as f64);
    }
    let t = x + G + 0.5;
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

/// The x with I_x(a, b) = q (bisection: I is increasing in x).
pub fn beta_inc_inv(a: f64, b: f64, q: f64) -> f64 {
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if beta_inc(a, b, mid) < q {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo < 1e-16 {
            break;
        }
    }
    0.5 * (lo + hi)
}

/// Bad slots among exposed and unexposed slots, and what they say.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct RateRatio {
    /// Bad slots with the exposure, and slots with it.
    pub exposed_bad: u64,
    pub exposed: u64,
    /// Bad slots without it, and slots without it.
    pub unexposed_bad: u64,
    pub unexposed: u64,
    /// How many times likelier a bad slot is with the exposure; None when
    /// a group has no slots, infinite when no unexposed slot was bad.
    pub ratio: Option<f64>,
    /// Its exact 95% interval (Poisson, conditional on the bad slots).
    pub low: Option<f64>,
    pub high: Option<f64>,
    /// The share of all bad slots the exposure accounts for: of the bad
    /// slots it was in, the part beyond what the unexposed rate predicts.
    pub attributable_share: Option<f64>,
}

/// The rate ratio of bad slots, exposed vs unexposed, with its exact 95%
/// interval.
pub fn rate_ratio(exposed_bad: u64, exposed: u64, unexposed_bad: u64, unexposed: u64) -> RateRatio {
    let mut r = RateRatio {
        exposed_bad,
        exposed,
        unexposed_bad,
        unexposed,
        ratio: None,
        low: None,
        high: None,
        attributable_share: None,
    };
    let (a, c) = (exposed_bad.min(exposed), unexposed_bad.min(unexposed));
    if exposed == 0 || unexposed == 0 {
        return r;
    }
    let (n1, n0) = (exposed as f64, unexposed as f64);
    let rate0 = c as f64 / n0;
    let rate1 = a as f64 / n1;
    r.ratio = Some(if c == 0 { f64::INFINITY } else { rate1 / rate0 }).filter(|_| a + c > 0);
    let m = (a + c) as f64;
    if a + c > 0 {
        // The exposed share of the bad slots: p = n1 RR / (n1 RR + n0).
        let to_ratio = |p: f64| {
            if p >= 1.0 {
                f64::INFINITY
            } else {
                p / (1.0 - p) * n0 / n1
            }
        };
        let p_low = if a == 0 {
            0.0
        } else {
            beta_inc_inv(a as f64, m - a as f64 + 1.0, 0.025)
        };
        let p_high = if c == 0 {
            1.0
        } else {
            beta_inc_inv(a as f64 + 1.0, m - a as f64, 0.975)
        };
        r.low = Some(to_ratio(p_low));
        r.high = Some(to_ratio(p_high));
        // Bad exposed slots beyond the unexposed rate, over all bad slots.
        r.attributable_share = Some(((a as f64 - rate0 * n1) / m).max(0.0));
    }
    r
}

/// Whether the interval excludes 1 on the high side: the exposure makes
/// bad slots likelier, by this data.
pub fn raises_risk(r: &RateRatio) -> bool {
    r.low.is_some_and(|l| l > 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64, rel: f64) -> bool {
        if want.is_infinite() {
            return got.is_infinite();
        }
        (got - want).abs() <= rel * want.abs().max(1e-300)
    }

    /// `python3 -c "from scipy import special; print(special.betainc(3.5,2,0.4),
    /// special.betainc(326,41,0.9), special.betainc(0.5,0.5,0.1),
    /// special.betaincinv(3,5,0.025), special.betaincinv(327,40,0.975),
    /// special.gammaln(171))"`
    /// (SciPy 1.17.1).
    #[test]
    fn incomplete_beta_and_its_inverse_match_scipy() {
        assert!(close(beta_inc(3.5, 2.0, 0.4), 0.125479177555481, 1e-10));
        assert!(close(beta_inc(326.0, 41.0, 0.9), 0.755551527037279, 1e-9));
        assert!(close(beta_inc(0.5, 0.5, 0.1), 0.204832764699133, 1e-10));
        assert!(close(beta_inc_inv(3.0, 5.0, 0.025), 0.0989882784425079, 1e-9));
        assert!(close(beta_inc_inv(327.0, 40.0, 0.975), 0.92076547976653, 1e-9));
        assert!(close(ln_gamma(0.5), std::f64::consts::PI.sqrt().ln(), 1e-12));
        assert!(close(ln_gamma(171.0), 706.5730622457875, 1e-12));
    }

    /// The exact conditional interval, against SciPy's beta quantiles
    /// (`stats.beta.ppf(0.025, a, m-a+1)`, `stats.beta.ppf(0.975, a+1, m-a)`,
    /// mapped by p/(1-p) n0/n1; SciPy 1.17.1). The first case is the
    /// incident's: 293,000 blocks, 63% in the slow phase, 1 in 800 small,
    /// 89% of those in the slow phase -> 4.8x (95% CI 3.4-6.8; the
    /// incident wrote 3.4-6.9).
    #[test]
    fn rate_ratios_and_exact_intervals_match_scipy() {
        type Counts = (u64, u64, u64, u64);
        let cases: [(Counts, (f64, f64, f64)); 6] = [
            (
                (326, 184_590, 40, 108_410),
                (4.78650793651, 3.43974875966, 6.82489180481),
            ),
            ((5, 100, 5, 100), (1.0, 0.230142468938, 4.34513457952)),
            ((0, 50, 3, 60), (0.0, 0.0, 2.90394227202)),
            ((7, 20, 0, 30), (f64::INFINITY, 2.16196277825, f64::INFINITY)),
            ((12, 400, 30, 4000), (4.0, 1.86509106834, 8.04529090036)),
            ((1, 10, 1, 1000), (100.0, 1.27393670837, 7849.68353163)),
        ];
        for ((a, n1, c, n0), (ratio, low, high)) in cases {
            let r = rate_ratio(a, n1, c, n0);
            assert!(close(r.ratio.unwrap(), ratio, 1e-9), "{r:?}");
            assert!(close(r.low.unwrap(), low, 1e-7), "{r:?} low vs {low}");
            assert!(close(r.high.unwrap(), high, 1e-7), "{r:?} high vs {high}");
        }
    }

    #[test]
    fn no_slots_or_no_bad_slots_conclude_nothing() {
        assert_eq!(rate_ratio(0, 0, 3, 10).ratio, None);
        assert_eq!(rate_ratio(0, 10, 0, 10).ratio, None);
        assert_eq!(rate_ratio(0, 10, 0, 10).low, None);
        assert!(!raises_risk(&rate_ratio(5, 100, 5, 100)));
        assert!(raises_risk(&rate_ratio(326, 184_590, 40, 108_410)));
    }

    #[test]
    fn the_attributable_share_is_the_excess_over_the_unexposed_rate() {
        // Unexposed rate 1%; 100 exposed slots would have had 1 bad; 21
        // had: 20 of the 30 bad slots are the exposure's.
        let r = rate_ratio(21, 100, 9, 900);
        assert!(close(r.attributable_share.unwrap(), 20.0 / 30.0, 1e-12), "{r:?}");
        // No excess: nothing attributed.
        assert_eq!(rate_ratio(1, 100, 9, 900).attributable_share, Some(0.0));
    }
}
