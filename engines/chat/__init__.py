"""OpenAI chat shapes shared by the engine's OpenAI routes and the rollout's agent gateway:
chat-template rendering, tool-call parsing, and the response bodies SGLang writes."""
