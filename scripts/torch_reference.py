#!/usr/bin/env python3
"""PyTorch reference logits for kiln's model zoo.

For each model NAME given on the command line, reads `DIR/NAME.weights.safetensors` (a state
dict exported by kiln's `ParamStore::save_safetensors`) and `DIR/NAME.input.safetensors`
(tensor `input`), builds the model in plain `torch.nn` with torchvision's module names (so
`load_state_dict(strict=True)` checks kiln's names and shapes against torchvision's), runs it in
eval mode and writes `DIR/NAME.output.safetensors` (tensor `output`).

torchvision is not installed in kiln's environment, so the architectures are restated here,
following torchvision's source (ResNet v1.5, MobileNetV2, MNASNet, SqueezeNet 1.1, AlexNet,
VGG, VisionTransformer); the BERT-style encoder is `nn.TransformerEncoder` behind BERT
embeddings, as in kiln's zoo.

    .deps/venv/bin/python scripts/torch_reference.py --dir DIR resnet18 vit ...
"""

import argparse
import sys
from collections import OrderedDict

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

NUM_CLASSES = 1000


# ----- ResNet --------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, block, layers, groups=1, width_per_group=64):
        super().__init__()
        self.inplanes = 64
        self.groups = groups
        self.base_width = width_per_group
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], 2)
        self.layer3 = self._make_layer(block, 256, layers[2], 2)
        self.layer4 = self._make_layer(block, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, NUM_CLASSES)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample, self.groups, self.base_width)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes, groups=self.groups, base_width=self.base_width))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ----- MobileNetV2 ---------------------------------------------------------------------------


def conv_norm_act(cin, cout, k=3, stride=1, groups=1, act=nn.ReLU6):
    # torchvision.ops.Conv2dNormActivation: conv (no bias), BN, activation -> names 0, 1, 2.
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        act(inplace=True),
    )


class InvertedResidual(nn.Module):
    def __init__(self, inp, oup, stride, expand_ratio):
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers = []
        if expand_ratio != 1:
            layers.append(conv_norm_act(inp, hidden, k=1))
        layers += [
            conv_norm_act(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self):
        super().__init__()
        setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2],
                   [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]
        features = [conv_norm_act(3, 32, stride=2)]
        cin = 32
        for t, c, n, s in setting:
            for i in range(n):
                features.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        features.append(conv_norm_act(cin, 1280, k=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, NUM_CLASSES))

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.classifier(x)


# ----- MNASNet -------------------------------------------------------------------------------

BN_MOMENTUM = 1 - 0.9997


class MnasResidual(nn.Module):
    def __init__(self, cin, cout, k, stride, exp):
        super().__init__()
        mid = cin * exp
        self.apply_residual = cin == cout and stride == 1
        self.layers = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid, momentum=BN_MOMENTUM),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, k, padding=k // 2, stride=stride, groups=mid, bias=False),
            nn.BatchNorm2d(mid, momentum=BN_MOMENTUM),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout, momentum=BN_MOMENTUM),
        )

    def forward(self, x):
        return self.layers(x) + x if self.apply_residual else self.layers(x)


def mnas_stack(cin, cout, k, stride, exp, repeats):
    blocks = [MnasResidual(cin, cout, k, stride, exp)]
    blocks += [MnasResidual(cout, cout, k, 1, exp) for _ in range(1, repeats)]
    return nn.Sequential(*blocks)


class MNASNet(nn.Module):
    def __init__(self):
        super().__init__()
        d = [32, 16, 24, 40, 80, 96, 192, 320]
        m = BN_MOMENTUM
        self.layers = nn.Sequential(
            nn.Conv2d(3, d[0], 3, padding=1, stride=2, bias=False),
            nn.BatchNorm2d(d[0], momentum=m),
            nn.ReLU(inplace=True),
            nn.Conv2d(d[0], d[0], 3, padding=1, stride=1, groups=d[0], bias=False),
            nn.BatchNorm2d(d[0], momentum=m),
            nn.ReLU(inplace=True),
            nn.Conv2d(d[0], d[1], 1, padding=0, stride=1, bias=False),
            nn.BatchNorm2d(d[1], momentum=m),
            mnas_stack(d[1], d[2], 3, 2, 3, 3),
            mnas_stack(d[2], d[3], 5, 2, 3, 3),
            mnas_stack(d[3], d[4], 5, 2, 6, 3),
            mnas_stack(d[4], d[5], 3, 1, 6, 2),
            mnas_stack(d[5], d[6], 5, 2, 6, 4),
            mnas_stack(d[6], d[7], 3, 1, 6, 1),
            nn.Conv2d(d[7], 1280, 1, padding=0, stride=1, bias=False),
            nn.BatchNorm2d(1280, momentum=m),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Sequential(nn.Dropout(p=0.2, inplace=True), nn.Linear(1280, NUM_CLASSES))

    def forward(self, x):
        return self.classifier(self.layers(x).mean([2, 3]))


# ----- SqueezeNet 1.1, AlexNet, VGG16 --------------------------------------------------------


class Fire(nn.Module):
    def __init__(self, cin, squeeze, e1, e3):
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, e1, 1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, e3, 3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], 1)


class SqueezeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(64, 16, 64, 64), Fire(128, 16, 64, 64),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(128, 32, 128, 128), Fire(256, 32, 128, 128),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(256, 48, 192, 192), Fire(384, 48, 192, 192),
            Fire(384, 64, 256, 256), Fire(512, 64, 256, 256),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Conv2d(512, NUM_CLASSES, 1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d((1, 1)),
        )

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


class AlexNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Linear(256 * 36, 4096), nn.ReLU(inplace=True),
            nn.Dropout(0.5), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, NUM_CLASSES),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class VGG16(nn.Module):
    def __init__(self):
        super().__init__()
        layers, cin = [], 3
        for v in [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                  512, 512, 512, "M"]:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 49, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, NUM_CLASSES),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ----- VisionTransformer (torchvision structure) ---------------------------------------------


class MLPBlock(nn.Sequential):
    def __init__(self, dim, mlp_dim):
        super().__init__(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(0.0),
                         nn.Linear(mlp_dim, dim), nn.Dropout(0.0))


class EncoderBlock(nn.Module):
    def __init__(self, heads, hidden, mlp_dim):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = MLPBlock(hidden, mlp_dim)

    def forward(self, inp):
        x = self.ln_1(inp)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x) + inp
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, seq, layers, heads, hidden, mlp_dim):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, hidden).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", EncoderBlock(heads, hidden, mlp_dim)) for i in range(layers)))
        self.ln = nn.LayerNorm(hidden, eps=1e-6)

    def forward(self, x):
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    def __init__(self, image=64, patch=8, layers=4, heads=4, hidden=256, mlp_dim=1024):
        super().__init__()
        self.patch, self.hidden = patch, hidden
        self.conv_proj = nn.Conv2d(3, hidden, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        seq = (image // patch) ** 2 + 1
        self.encoder = Encoder(seq, layers, heads, hidden, mlp_dim)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden, NUM_CLASSES)))

    def forward(self, x):
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.hidden, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


# ----- BERT-style encoder --------------------------------------------------------------------


class BertEmbeddings(nn.Module):
    def __init__(self, vocab=30522, max_pos=512, hidden=256):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.token_type_embeddings = nn.Embedding(2, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])
        x = (self.word_embeddings(ids) + self.position_embeddings(pos)
             + self.token_type_embeddings(torch.zeros_like(ids)))
        return self.dropout(self.LayerNorm(x))


class Bert(nn.Module):
    def __init__(self, hidden=256, layers=4, heads=4, ffn=1024):
        super().__init__()
        self.embeddings = BertEmbeddings(hidden=hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu",
                                           layer_norm_eps=1e-12, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, ids):
        return self.encoder(self.embeddings(ids))


MODELS = {
    "resnet18": lambda: ResNet(BasicBlock, [2, 2, 2, 2]),
    "resnet50": lambda: ResNet(Bottleneck, [3, 4, 6, 3]),
    "resnext50_32x4d": lambda: ResNet(Bottleneck, [3, 4, 6, 3], groups=32, width_per_group=4),
    "mobilenet_v2": MobileNetV2,
    "mnasnet1_0": MNASNet,
    "squeezenet1_1": SqueezeNet,
    "alexnet": AlexNet,
    "vgg16": VGG16,
    "vit": VisionTransformer,
    "bert": Bert,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("models", nargs="+", choices=sorted(MODELS))
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.models:
        model = MODELS[name]().eval()
        state = load_file(f"{args.dir}/{name}.weights.safetensors")
        model.load_state_dict(state, strict=True)
        x = load_file(f"{args.dir}/{name}.input.safetensors")["input"]
        with torch.no_grad():
            y = model(x).contiguous()
        save_file({"output": y}, f"{args.dir}/{name}.output.safetensors")
        params = sum(p.numel() for p in model.parameters())
        print(f"{name}: torch {torch.__version__}, {params} parameters, output "
              f"{list(y.shape)}, max |y| {y.abs().max().item():.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
