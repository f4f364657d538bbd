"""OpenAI's Responses API: routes (`api`), the request body and its input items (`items`),
the prompt and the exact continuation of a stored turn (`prompt`), stored responses in memory
or in SQLite (`store`, `sqlite_store`), their listed input items (`listing`), the pins that
keep an active conversation's KV in the pool (`retention`) and the response object and its
typed events (`wire`)."""
