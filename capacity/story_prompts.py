"""Fixed prompts for exactness checks (the end-to-end tests, scripts/dev/gpu_check.py): TinyStories-like text cut at
various lengths, so that a story model continues them sensibly and the lengths cover 1 to about 290 tokens."""

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "friends. One day, she saw a big red ball under a tree. She ran to the ball and picked it up. It was shiny "
    "and new. Lily wanted to share the ball with her friend Tom, so she went to find him. Tom was sitting on a "
    "bench, eating an apple. He was sad because he lost his toy car. Lily said, \"Tom, do you want to play with "
    "my ball?\" Tom smiled and said yes. They played with the ball all day long. They threw it high in the sky "
    "and kicked it across the grass. When the sun went down, their moms called them home. Lily and Tom were "
    "tired but happy. The next day, Lily went back to the park. She looked for the ball, but it was gone. She "
    "asked a bird in the tree, \"Have you seen my ball?\" The bird said, \"A dog took it to the pond.\" Lily ran "
    "to the pond and saw the dog. The dog was playing with the ball in the water. Lily laughed and jumped in to "
    "play too. The water was cold, but she did not mind. Her mom came and saw her all wet. She was not angry. "
    "She gave Lily a warm towel and a big hug. From that day on, Lily and the dog were best friends, and they "
    "played together in the park every day. One morning the dog brought a little kitten to the park. The "
    "kitten was small and gray and very shy. Lily gave the kitten some milk and it began to purr."
)

WORD_COUNTS = (0, 1, 3, 7, 12, 20, 30, 40, 50, 60, 75, 90, 105, 120, 135, 150)  # 1 to 290 tokens
MAX_TOKENS = (200, 32, 150, 64, 100, 45, 200, 80, 33, 120, 60, 90, 140, 70, 50, 180)


def story_prompts() -> list[str]:
    """16 different prompts, from the empty string (BOS only) to a few hundred tokens."""
    words = STORY.split(" ")
    return [" ".join(words[:n]) for n in WORD_COUNTS]
