"""Tasks and what is admitted for them: the task book, one owner of every task and its
lifecycle (`tasks`), a task's state and refusals (`task_state`), what admission counts of
the tasks (`task_load`), which settled task trees the book may forget (`settled_tasks`),
the task classes' paces learned live (`task_paces`), and the admission controller that
judges each turn against the box's load (`admission`)."""
