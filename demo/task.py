"""The demo's spoken task ("tone-coded digits"): audio, prompts and templated replies.

An audio of 2-5 digits, each digit d a 0.24 s tone at 400 + 170*d Hz with a random level, slight
detuning and noise, separated by 80 ms gaps (so one digit is ~4 encoder frames of 80 ms). The user
asks one of a few questions about it; the reply is templated:

    user:      <|audioplaceholder|> repeat the digits and add them .
    assistant: you said three one four . the sum is eight .

The reply's words depend on what the audio says (digits, their count, first/last digit, their
sum), so a drafter has real structure to learn (audio-conditioned content inside fixed templates).
A random-init target would have none; it is fine for unit tests, never for the demo.
"""

from __future__ import annotations

import numpy as np

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
         "nineteen")
TENS = ("", "", "twenty", "thirty", "forty")
COUNTS = {2: "two", 3: "three", 4: "four", 5: "five"}

TASKS = {
    # name: (prompt, reply builder, weight)
    "repeat_add": ("repeat the digits and add them .",
                   lambda d: f"you said {_say(d)} . the sum is {_num(sum(d))} .", 4),
    "repeat": ("what did i say ?", lambda d: f"you said {_say(d)} .", 2),
    "sum": ("what is the sum ?", lambda d: f"the sum is {_num(sum(d))} .", 2),
    "count": ("how many digits ?", lambda d: f"there are {COUNTS[len(d)]} digits .", 1),
    "first": ("what is the first digit ?", lambda d: f"the first digit is {DIGITS[d[0]]} .", 1),
    "last": ("what is the last digit ?", lambda d: f"the last digit is {DIGITS[d[-1]]} .", 1),
}
SAMPLE_RATE = 16000
TONE_S, GAP_S, EDGE_S = 0.24, 0.08, 0.08


def _say(d: list[int]) -> str:
    return " ".join(DIGITS[x] for x in d)


def _num(n: int) -> str:
    if n < 10:
        return DIGITS[n]
    if n < 20:
        return TEENS[n - 10]
    return TENS[n // 10] + ("" if n % 10 == 0 else " " + DIGITS[n % 10])


def vocabulary() -> list[str]:
    words: list[str] = []
    for prompt, _, _ in TASKS.values():
        words += prompt.split()
    words += list(DIGITS) + list(TEENS) + [t for t in TENS if t]
    words += "you said the sum is there are digits first last digit .".split()
    return list(dict.fromkeys(words))


def tone_audio(digits: list[int], rng: np.random.Generator) -> np.ndarray:
    """float32 waveform at 16 kHz: one tone per digit with gaps, random level, detune and noise."""
    return _tones(digits, rng)[0]


def _tones(digits: list[int], rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The waveform and each digit's (start sample, end sample, digit)."""
    sr = SAMPLE_RATE
    parts = [np.zeros(int(EDGE_S * sr), np.float32)]
    spans, pos = [], parts[0].shape[0]
    for d in digits:
        n = int(TONE_S * sr)
        f = (400 + 170 * d) * (1 + rng.uniform(-0.01, 0.01))
        t = np.arange(n) / sr
        env = np.minimum(1, np.minimum(t, t[::-1]) / 0.01)  # 10 ms ramps
        parts += [(rng.uniform(0.2, 0.6) * env * np.sin(2 * np.pi * f * t)).astype(np.float32),
                  np.zeros(int(GAP_S * sr), np.float32)]
        spans.append((pos, pos + n, d))
        pos += n + parts[-1].shape[0]
    parts.append(np.zeros(int(EDGE_S * sr), np.float32))
    wave = np.concatenate(parts)
    return (wave + rng.normal(0, 0.01, wave.shape)).astype(np.float32), spans


def frame_labels(spans: list[tuple[int, int, int]], n_frames: int, frame_samples: int) -> list[int]:
    """Per encoder frame: the digit whose tone covers the frame's centre, else 10 (silence)."""
    out = []
    for k in range(n_frames):
        c = (k + 0.5) * frame_samples
        out.append(next((d for a, b, d in spans if a <= c < b), 10))
    return out


def sample_example(rng: np.random.Generator) -> tuple[list[int], str, str, str]:
    """(digits, task, prompt, templated reply)."""
    names = list(TASKS)
    w = np.array([TASKS[n][2] for n in names], dtype=np.float64)
    task = names[rng.choice(len(names), p=w / w.sum())]
    digits = [int(x) for x in rng.integers(0, 10, size=int(rng.integers(2, 6)))]
    prompt, reply, _ = TASKS[task]
    return digits, task, prompt, reply(digits)
