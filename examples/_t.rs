fn main() -> kiln::Result<()> {
    let name = std::env::args().nth(1).unwrap();
    if let Some(t) = std::env::args().nth(2) {
        tch::set_num_threads(t.parse().unwrap());
    }
    let m = kiln::zoo::build(&name, 0)?;
    let x = m.example_inputs(4, 1)?;
    for _ in 0..6 {
        let t = std::time::Instant::now();
        tch::no_grad(|| m.forward(&x, false))?;
        println!("{name}: {:.3} ms", t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(())
}
