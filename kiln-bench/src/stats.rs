//! Statistics of the harness: median, mean, geometric mean and Welch's t-test.
//!
//! Welch's test (unequal variances) gives the p-value printed next to each speedup: the
//! probability of seeing eager and compiled means this far apart if the two took equally long.
//! PyTorch's `benchmarks/dynamo` harness prints `SAME` when it is above 0.1 ([`SAME_THRESHOLD`]).

/// p-values above this are printed as `SAME`: no evidence that eager and compiled differ.
pub const SAME_THRESHOLD: f64 = 0.1;

/// The median (the mean of the two middle values for an even count); `None` when empty or
/// when a value is NaN.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The arithmetic mean; `None` when empty.
pub fn mean(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    Some(values.iter().sum::<f64>() / values.len() as f64)
}

/// The unbiased sample variance (divides by `n - 1`); `None` for fewer than two values.
pub fn variance(values: &[f64]) -> Option<f64> {
    if values.len() < 2 {
        return None;
    }
    let m = mean(values)?;
    Some(values.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (values.len() - 1) as f64)
}

/// The geometric mean `exp(mean(ln v))`; `None` when empty or when a value is not positive
/// and finite.
pub fn geomean(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|&v| !(v > 0.0 && v.is_finite())) {
        return None;
    }
    Some((values.iter().map(|v| v.ln()).sum::<f64>() / values.len() as f64).exp())
}

/// The result of [`welch_t_test`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TTest {
    /// The t statistic, `(mean(a) - mean(b)) / sqrt(var(a)/na + var(b)/nb)`.
    pub t: f64,
    /// Welch–Satterthwaite degrees of freedom.
    pub df: f64,
    /// The two-sided p-value.
    pub p: f64,
}

/// Welch's two-sample t-test (two-sided, unequal variances), as
/// `scipy.stats.ttest_ind(a, b, equal_var=False)`.
///
/// `None` when either sample has fewer than two values. When both samples have zero variance
/// the p-value is 1 for equal means and 0 otherwise.
pub fn welch_t_test(a: &[f64], b: &[f64]) -> Option<TTest> {
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let (ma, mb) = (mean(a)?, mean(b)?);
    let (va, vb) = (variance(a)?, variance(b)?);
    let (sa, sb) = (va / na, vb / nb);
    let se2 = sa + sb;
    if se2 == 0.0 {
        let equal = ma == mb;
        return Some(TTest {
            t: if equal { 0.0 } else { f64::INFINITY },
            df: na + nb - 2.0,
            p: if equal { 1.0 } else { 0.0 },
        });
    }
    let t = (ma - mb) / se2.sqrt();
    let df = se2 * se2 / (sa * sa / (na - 1.0) + sb * sb / (nb - 1.0));
    Some(TTest {
        t,
        df,
        p: student_t_two_sided(t, df),
    })
}

/// `P(|T| >= |t|)` for Student's t with `df` degrees of freedom:
/// the regularized incomplete beta `I_{df/(df+t²)}(df/2, 1/2)`.
pub fn student_t_two_sided(t: f64, df: f64) -> f64 {
    if t.is_nan() || df.is_nan() || df <= 0.0 {
        return f64::NAN;
    }
    if t.is_infinite() {
        return 0.0;
    }
    let x = df / (df + t * t);
    regularized_incomplete_beta(x, df / 2.0, 0.5).clamp(0.0, 1.0)
}

/// `ln Γ(x)` for `x > 0` (Lanczos approximation, g = 7, 9 terms; relative error ~1e-15).
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
        // Reflection: Γ(x)Γ(1-x) = π / sin(πx).
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).abs().ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + G + 0.5;
    for (i, c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularized incomplete beta function `I_x(a, b)` (continued fraction, modified Lentz).
pub fn regularized_incomplete_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let ln_front = ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln();
    // The continued fraction converges fast for x < (a+1)/(a+b+2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0) {
        ln_front.exp() * beta_cf(x, a, b) / a
    } else {
        1.0 - ln_front.exp() * beta_cf(1.0 - x, b, a) / b
    }
}

fn beta_cf(x: f64, a: f64, b: f64) -> f64 {
    const TINY: f64 = 1e-300;
    const EPS: f64 = 1e-15;
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 - qab * x / qap;
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    for m in 1..=300 {
        let m = m as f64;
        let m2 = 2.0 * m;
        let aa = m * (b - m) * x / ((qam + m2) * (a + m2));
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
        let aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
        d = 1.0 + aa * d;
        if d.abs() < TINY {
            d = TINY;
        }
        c = 1.0 + aa / c;
        if c.abs() < TINY {
            c = TINY;
        }
        d = 1.0 / d;
        let del = d * c;
        h *= del;
        if (del - 1.0).abs() < EPS {
            break;
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-300)
    }

    #[test]
    fn median_odd_even_empty_nan() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn geomean_matches_scipy() {
        // scipy.stats.gmean([1.38, 1.227, 1.544, 1.085, 2.028]) (pytorch#88904's first five rows)
        let g = geomean(&[1.38, 1.227, 1.544, 1.085, 2.028]).unwrap();
        assert!(close(g, 1.418_971_676_569_381_2, 1e-12), "{g}");
        assert_eq!(geomean(&[2.0, 8.0]), Some(4.0));
        assert_eq!(geomean(&[]), None);
        assert_eq!(geomean(&[1.0, 0.0]), None);
        assert_eq!(geomean(&[1.0, f64::INFINITY]), None);
    }

    #[test]
    fn ln_gamma_known_values() {
        assert!(close(ln_gamma(1.0).exp(), 1.0, 1e-13));
        assert!(close(ln_gamma(5.0).exp(), 24.0, 1e-13));
        assert!(close(
            ln_gamma(0.5).exp(),
            std::f64::consts::PI.sqrt(),
            1e-13
        ));
        assert!(close(ln_gamma(0.1).exp(), 9.513_507_698_668_732, 1e-12));
    }

    #[test]
    fn welch_matches_scipy() {
        // Values from scipy.stats.ttest_ind(a, b, equal_var=False) (scipy 1.x).
        type Case<'a> = (&'a [f64], &'a [f64], f64, f64, f64);
        let cases: &[Case] = &[
            (
                &[1.0, 2.0, 3.0, 4.0, 5.0],
                &[2.0, 4.0, 6.0, 8.0, 10.0, 12.0],
                -2.376_354_103_144_018_3,
                6.972_255_729_794_934,
                0.049_284_338_206_730_53,
            ),
            (
                &[10.1, 10.3, 9.9, 10.2, 10.0, 10.4],
                &[10.0, 10.2, 10.1, 9.8, 10.3],
                0.608_503_967_189_75,
                8.544_345_657_595_148,
                0.558_679_942_010_803,
            ),
            (
                &[0.5, 0.52, 0.49, 0.51],
                &[0.7, 0.72, 0.69, 0.75, 0.71, 0.74, 0.70],
                -19.873_845_697_647_884,
                8.943_952_017_358_907,
                1.042_282_304_916_257_8e-8,
            ),
        ];
        for (a, b, t, df, p) in cases {
            let r = welch_t_test(a, b).unwrap();
            assert!(close(r.t, *t, 1e-10), "t {} vs {t}", r.t);
            assert!(close(r.df, *df, 1e-10), "df {} vs {df}", r.df);
            assert!(close(r.p, *p, 1e-7), "p {} vs {p}", r.p);
        }
    }

    #[test]
    fn student_t_known_value() {
        // 2 * scipy.stats.t.sf(2.0, 3.5)
        assert!(close(
            student_t_two_sided(2.0, 3.5),
            0.126_138_522_575_913_43,
            1e-9
        ));
        assert!(close(student_t_two_sided(0.0, 10.0), 1.0, 1e-12));
        assert_eq!(student_t_two_sided(f64::INFINITY, 4.0), 0.0);
    }

    #[test]
    fn welch_degenerate_samples() {
        assert_eq!(welch_t_test(&[1.0], &[1.0, 2.0]), None);
        assert_eq!(welch_t_test(&[2.0, 2.0], &[2.0, 2.0]).unwrap().p, 1.0);
        assert_eq!(welch_t_test(&[2.0, 2.0], &[3.0, 3.0]).unwrap().p, 0.0);
        // One constant sample is fine.
        let r = welch_t_test(&[1.0, 1.0, 1.0], &[1.0, 2.0, 3.0]).unwrap();
        assert!(r.p > 0.1 && r.p < 1.0, "{r:?}");
    }
}
