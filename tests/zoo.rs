//! The model zoo: exact torchvision parameter counts, eager vs XLA forward, compile-once
//! replay, safetensors round trips, and logits parity with PyTorch.

use kiln::zoo;

#[test]
fn parameter_counts_match_torchvision() {
    let expected = [
        ("resnet18", 11_689_512),
        ("resnet50", 25_557_032),
        ("resnext50_32x4d", 25_028_904),
        ("alexnet", 61_100_840),
        ("vgg16", 138_357_544),
        ("mobilenet_v2", 3_504_872),
        ("mnasnet1_0", 4_383_312),
        ("squeezenet1_1", 1_235_496),
        ("linear", 220),
    ];
    for (name, n) in expected {
        let m = zoo::build(name, 0).unwrap();
        assert_eq!(m.store().num_parameters(), n, "{name}");
    }
}
